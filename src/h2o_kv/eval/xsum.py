"""0-shot XSUM summarization under a KV budget, scored with ROUGE-1/2/L (``rouge-score``).

The data is the H2O paper's own HELM-derived file ``xsum/xsum_0shot.jsonl`` (Zhang et al. 2023,
arXiv:2306.14048, Fig. 4/Table 6): each line holds the prompt (``article``: ``"###\\nArticle: ...\\n\\nSummarize
the above article in 1 sentence.\\n"``), the reference ``summary_gt`` and the generation settings ``max_tokens``
(64) and ``stop`` (``["###"]``). Decoding is greedy (the file's ``temperature`` is not used, so runs are
deterministic and policies are compared on identical decoding rules).

The prompt is the article; its cache is compressed to the budget after the prefill (:meth:`~h2o_kv.Budget.entries`
of the ``L`` prompt tokens) and every generated token then evicts one entry, as ``model.generate`` with an
:class:`~h2o_kv.H2OCache` would (:mod:`h2o_kv.eval.runner`). By default the prompt is wrapped in the model's chat
template (a 135M instruct model summarizes far better that way); ``raw_prompt=True`` feeds the file's text as is.
ROUGE uses Porter stemming, as HELM does. Finished items go to an item log, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness.data import data_path, sha256
from ..harness.setting import KVSetting
from ..harness.tables import mean
from .options import check_options, option_int, option_path
from .prompts import chat_prompt_ids, generate_text, has_chat_template
from .results import ItemLog, finish_result, item_log_path
from .runner import KVRunner

XSUM_FILE = "xsum/xsum_0shot.jsonl"
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def read_xsum(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The items of an XSUM 0-shot file, checked: ``article``/``summary_gt`` strings, ``max_tokens``, ``stop``."""
    path = data_path(XSUM_FILE) if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"XSUM file {path} not found")
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("article", "summary_gt")):
            raise ValueError(f"{path}:{number} needs string fields 'article' and 'summary_gt'")
        max_tokens, stop = row.get("max_tokens", 64), row.get("stop", [])
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}:{number}: max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"{path}:{number}: stop must be a list of non-empty strings, got {stop!r}")
        items.append({"article": row["article"], "summary": row["summary_gt"], "max_tokens": max_tokens, "stop": stop})
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


@dataclass
class XsumJob:
    """A validated XSUM run (see :meth:`create`)."""

    setting: KVSetting
    limit: int | None
    raw_prompt: bool
    path: Path
    items: list[dict[str, Any]] = field(repr=False)

    @classmethod
    def create(
        cls, setting: KVSetting, *, limit: int | None = None, raw_prompt: bool = False, path: str | Path | None = None
    ) -> XsumJob:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"--limit must be an integer >= 1, got {limit!r}")
        path = data_path(XSUM_FILE) if path is None else Path(path)
        items = read_xsum(path)
        return cls(setting, limit, raw_prompt, path, items[:limit] if limit else items)

    @property
    def label(self) -> str:
        prompt = "raw prompt" if self.raw_prompt else "chat template"
        return f"XSUM 0-shot ({prompt}{'' if self.limit is None else f', limit {self.limit}'})"

    def prompt_ids(self, tokenizer, article: str) -> list[int]:
        if self.raw_prompt or not has_chat_template(tokenizer):
            return tokenizer.encode(article, add_special_tokens=False)
        return chat_prompt_ids(tokenizer, article)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (Porter stemming) of one summary."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = scorer.score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def summarize(runner: KVRunner, tokenizer, ids: list[int], max_tokens: int, stop: list[str]) -> tuple[str, Any]:
    """Greedy summary of a prompt under the runner's KV setting, cut before the first stop string."""
    text, session = generate_text(runner, tokenizer, ids, max_tokens, until=stop)
    return text.strip(), session


def run_xsum(
    job: XsumJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str,
    progress: Callable[[int], None] | None = None,
    keep_item_log: bool = False,
) -> dict[str, Any]:
    """Summarize every item, score it, write the result JSON (``rouge1/2/L`` means with ``_stderr``)."""
    runner = KVRunner(model, job.setting, tokenizer=tokenizer)
    log = None
    if json_path is not None:
        settings = {"model": model_name, **job.setting.fields(), "raw_prompt": job.raw_prompt, "data": sha256(job.path)}
        log = ItemLog(item_log_path(json_path), settings)
    start = time.time()
    rows = []
    for index, item in enumerate(job.items):
        key = str(index)
        if log is not None and key in log:
            rows.append(log.done[key])
        else:
            ids = job.prompt_ids(tokenizer, item["article"])
            prediction, session = summarize(runner, tokenizer, ids, item["max_tokens"], item["stop"])
            row = {
                "key": key,
                "prediction": prediction,
                "prompt_tokens": len(ids),
                "kept": session.kept,
                **{k: round(v, 6) for k, v in rouge_scores(prediction, item["summary"]).items()},
            }
            if log is not None:
                log.add(key, **{k: v for k, v in row.items() if k != "key"})
            rows.append(row)
        if progress is not None:
            progress(1)
    metrics: dict[str, Any] = {}
    for name in ROUGE_TYPES:
        estimate = mean([row[name] for row in rows])
        metrics[name], metrics[f"{name}_stderr"] = estimate.value, estimate.se
    kept = sum(row["kept"] / row["prompt_tokens"] for row in rows) / len(rows)
    fields = {
        "label": job.label,
        "model": model_name,
        "primary_metric": "rouge2",
        "limit": job.limit,
        "n": len(rows),
        "kv_kept_ratio": kept,
        "settings": {
            "limit": job.limit,
            "prompt": "raw" if job.raw_prompt else "chat template",
            "decoding": "greedy; max_tokens and stop from the file",
            "rouge": "rouge-score F-measure, Porter stemmer",
            "budget_of": "prompt length (heavy = recent = max(1, floor(budget * L / 2)))",
        },
        "data": {"name": str(job.path.name), "sha256": sha256(job.path)},
        "items": {name: [row[name] for row in rows] for name in ROUGE_TYPES},
        "predictions": [row["prediction"] for row in rows],
        "time_s": round(time.time() - start, 1),
    }
    return finish_result(
        json_path, "xsum", metrics, fields, setting=job.setting, device=model.device, keep_item_log=keep_item_log
    )


# -- `h2o-kv eval sweep --kind xsum` (registered in h2o_kv.eval.kinds) ----------------------------------------


def sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("xsum", options, {"limit", "raw_prompt", "data"})
    settings = {
        "limit": option_int(options, "limit"),
        "raw_prompt": bool(options.get("raw_prompt", False)),
        "path": option_path(options, "data"),
    }
    XsumJob.create(KVSetting("dynamic"), **settings)  # reads and checks the file before any cell runs
    return settings


def sweep_run(settings, setting: KVSetting, path: Path, models, progress) -> dict[str, Any]:
    job = XsumJob.create(setting, **settings)
    return run_xsum(job, models.model(), models.tokenizer(), path, model_name=models.label, progress=progress)
