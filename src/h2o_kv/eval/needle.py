"""Needle in a haystack under a KV budget: can the model still retrieve one fact after its cache is compressed?

The haystack is the Paul Graham essays of the original pressure test (Kamradt, LLMTest_NeedleInAHaystack),
concatenated in file-name order. For a document of ``length`` tokens, the needle sentence (the original test's
"The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.") is inserted at
``depth`` percent of the document, moved back to the previous sentence end; the question follows the document in
the model's chat template. The prompt is prefilled, compressed to the budget (ratio of the whole prompt), and the
answer is generated greedily with eviction after every token.

This needle and prompt were chosen because the default model (SmolLM2-135M-Instruct) answers them correctly with
the full cache at every tested length and depth (1k-4k tokens); shorter synthetic needles (a code number, a
magic word) failed at 4k tokens even with the full cache. Score = fraction of the answer's key phrases
(``eat a sandwich``, ``Dolores Park``) found in the generated answer (case-insensitive), so 0, 0.5 or 1 per cell.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness import records
from ..harness.data import data_path, sha256
from ..harness.setting import KVSetting
from .options import check_options
from .prompts import chat_prompt_ids, generate_text, has_chat_template
from .results import ItemLog, finish_result, item_log_path
from .runner import KVRunner
from .server import ServerRunner, server_field

HAYSTACK_DIR = "haystack/PaulGrahamEssays"
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
KEYWORDS = ("eat a sandwich", "Dolores Park")
PROMPT = "{document}\n\nBased on the text above, answer the question. {question} Answer briefly."
MAX_NEW_TOKENS = 32


def haystack_files(folder: str | Path | None = None) -> list[Path]:
    """The essays of the haystack folder (default: the shared data's), in file-name order."""
    folder = data_path(HAYSTACK_DIR) if folder is None else Path(folder)
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"haystack folder {folder} holds no .txt essays")
    return files


def parse_ints(value: str | Sequence[int], what: str, low: int, high: int | None = None) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``, each checked to lie in ``[low, high]``."""
    if isinstance(value, str):
        try:
            values = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--{what} must be comma-separated integers, got {value!r}") from None
    else:
        values = [int(v) for v in value]
    if not values:
        raise ValueError(f"--{what} is empty")
    for v in values:
        if v < low or (high is not None and v > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"--{what}: {v} is out of range {bound}")
    return list(dict.fromkeys(values))


@dataclass
class NeedleJob:
    """A validated needle grid (see :meth:`create`)."""

    setting: KVSetting
    lengths: list[int]
    depths: list[int]
    files: list[Path] = field(repr=False)
    haystack_ids: list[int] = field(repr=False)

    @classmethod
    def create(
        cls,
        setting: KVSetting,
        lengths: str | Sequence[int],
        depths: str | Sequence[int],
        tokenizer,
        *,
        max_length: int | None = None,
        folder: str | Path | None = None,
    ) -> NeedleJob:
        """Check the grid and tokenize the haystack; ``max_length`` is the model's context (prompt must fit)."""
        needle_tokens = len(tokenizer.encode(" " + NEEDLE, add_special_tokens=False))
        lengths = parse_ints(lengths, "lengths", needle_tokens + 16, None if max_length is None else max_length - 128)
        depths = parse_ints(depths, "depths", 0, 100)
        files = haystack_files(folder)
        text = "".join(path.read_text(encoding="utf-8") for path in files)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if max(lengths) > len(ids):
            raise ValueError(f"--lengths: {max(lengths)} tokens exceed the haystack's {len(ids)} tokens")
        return cls(setting, sorted(lengths), sorted(depths), files, ids)

    def data(self) -> dict[str, Any]:
        digest = hashlib.sha256("".join(sha256(p) for p in self.files).encode()).hexdigest()
        return {"name": HAYSTACK_DIR, "sha256": digest, "files": len(self.files)}

    def document(self, tokenizer, length: int, depth: int) -> tuple[str, int]:
        """The haystack's first tokens with the needle inserted at ``depth`` %: (text, needle token offset)."""
        needle_ids = tokenizer.encode(" " + NEEDLE, add_special_tokens=False)
        body = self.haystack_ids[: length - len(needle_ids)]
        at = round(len(body) * depth / 100)
        if 0 < at < len(body):  # back to the end of a sentence, as the original test does
            while at > 0 and "." not in tokenizer.decode(body[at - 1 : at]):
                at -= 1
        text = tokenizer.decode(body[:at]) + " " + NEEDLE + tokenizer.decode(body[at:])
        return text, at

    def prompt_ids(self, tokenizer, length: int, depth: int) -> tuple[list[int], int]:
        document, at = self.document(tokenizer, length, depth)
        content = PROMPT.format(document=document.strip(), question=QUESTION)
        if has_chat_template(tokenizer):
            ids = chat_prompt_ids(tokenizer, content)
        else:
            ids = tokenizer.encode(content + "\nAnswer:", add_special_tokens=False)
        return ids, at


def score_answer(answer: str) -> float:
    """Fraction of :data:`KEYWORDS` present in ``answer`` (case-insensitive)."""
    text = " ".join(answer.lower().split())
    return sum(keyword.lower() in text for keyword in KEYWORDS) / len(KEYWORDS)


def run_needle(
    job: NeedleJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str,
    png: str | Path | None = None,
    compare: Sequence[dict[str, Any]] = (),
    progress: Callable[[int], None] | None = None,
    keep_item_log: bool = False,
    runner=None,
) -> dict[str, Any]:
    """Run the grid (resumable per cell), write the JSON and, with ``png``, the heatmap (depth x length).
    ``runner``: where the cells run instead of ``model`` (a :class:`~h2o_kv.eval.server.ServerRunner`)."""
    runner = runner or KVRunner(model, job.setting, tokenizer=tokenizer)
    log = None
    if json_path is not None:
        settings = {"model": model_name, **job.setting.fields(), "needle": NEEDLE, "question": QUESTION}
        if isinstance(runner, ServerRunner):  # a server's cells are not the transformers backend's: another log
            settings["server"] = runner.xargs
        log = ItemLog(item_log_path(json_path), settings)
    start = time.time()
    cells = []
    for length in job.lengths:
        for depth in job.depths:
            key = f"{length}:{depth}"
            if log is not None and key in log:
                cells.append(log.done[key])
            else:
                ids, at = job.prompt_ids(tokenizer, length, depth)
                text, session = generate_text(runner, tokenizer, ids, MAX_NEW_TOKENS)
                answer = text.strip()
                cell = {
                    "key": key, "length": length, "depth": depth, "prompt_tokens": len(ids), "needle_at": at,
                    "kept": session.kept, "answer": answer, "score": score_answer(answer),
                }  # fmt: skip
                if log is not None:
                    log.add(key, **{k: v for k, v in cell.items() if k != "key"})
                cells.append(cell)
            if progress is not None:
                progress(1)
    metrics: dict[str, Any] = {"score": sum(c["score"] for c in cells) / len(cells)}
    for length in job.lengths:
        row = [c["score"] for c in cells if c["length"] == length]
        metrics[f"score_{length}"] = sum(row) / len(row)
    fields = {
        "label": f"needle in a haystack (lengths {','.join(map(str, job.lengths))})",
        "model": model_name,
        "primary_metric": "score",
        "lengths": job.lengths,
        "depths": job.depths,
        "cells": [{k: v for k, v in c.items() if k != "key"} for c in cells],
        "kv_kept_ratio": sum(c["kept"] / c["prompt_tokens"] for c in cells) / len(cells),
        "settings": {
            "needle": NEEDLE,
            "question": QUESTION,
            "keywords": list(KEYWORDS),
            "prompt": PROMPT,
            "max_new_tokens": MAX_NEW_TOKENS,
            "decoding": "greedy",
            "budget_of": "prompt length (heavy = recent = max(1, floor(budget * L / 2)))",
        },
        "data": job.data(),
        "time_s": round(time.time() - start, 1),
        **server_field(runner),
    }
    record = finish_result(
        json_path, "needle", metrics, fields, setting=job.setting, device=runner.device, keep_item_log=keep_item_log
    )
    if png is not None:
        plot_heatmaps([record, *compare], png)
    return record


def _title(record: dict[str, Any]) -> str:
    if not records.bounded(record):
        return str(record.get("policy"))
    budget = record.get("budget")
    size = (
        f"{100 * budget:g}%" if isinstance(budget, (int, float)) else f"H{record.get('heavy')}+R{record.get('recent')}"
    )
    return f"{record.get('policy')} @ {size}"


def plot_heatmaps(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One heatmap per needle result (rows depth %, columns length), side by side, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not records:
        raise ValueError("no needle results to plot")
    columns = min(len(records), 6)
    rows = -(-len(records) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.2 + 2.6 * columns, 0.4 + 4.0 * rows), squeeze=False)
    fig.subplots_adjust(wspace=0.4, hspace=0.5)
    for ax in axes.flat[len(records) :]:
        ax.axis("off")
    image = None
    for ax, record in zip(axes.flat[: len(records)], records, strict=True):
        if record.get("kind") != "needle":
            raise ValueError(f"{record.get('_path', 'a record')} is not a needle result")
        lengths, depths = record["lengths"], record["depths"]
        grid = np.full((len(depths), len(lengths)), np.nan)
        for cell in record["cells"]:
            grid[depths.index(cell["depth"]), lengths.index(cell["length"])] = cell["score"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=8)
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.1f}".rstrip("0").rstrip("."), ha="center", va="center", fontsize=7)
        title = _title(record).replace("kvpress:", "kvpress ").replace(" @ ", "\n@ ")
        ax.set_title(f"{title}, mean {record['metrics']['score']:.2f}", fontsize=9)
        ax.set_xlabel("document tokens", fontsize=8)
    for row in axes:
        row[0].set_ylabel("needle depth", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="score")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# -- `h2o-kv eval sweep --kind needle` (registered in h2o_kv.eval.kinds) --------------------------------------


def sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("needle", options, {"lengths", "depths"})
    settings = {
        "lengths": str(options.get("lengths", "1024,2048,4096")),
        "depths": str(options.get("depths", "0,25,50,75,100")),
    }
    parse_ints(settings["lengths"], "lengths", 1)
    parse_ints(settings["depths"], "depths", 0, 100)
    return settings


def sweep_run(settings, setting: KVSetting, path: Path, models, progress) -> dict[str, Any]:
    from ..models import model_context_length

    model = models.model()
    job = NeedleJob.create(setting, settings["lengths"], settings["depths"], models.tokenizer(),
                           max_length=model_context_length(model))  # fmt: skip
    return run_needle(job, model, models.tokenizer(), path, model_name=models.label, progress=progress)
