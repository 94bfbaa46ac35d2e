"""lm-eval-harness tasks under a KV budget (``h2o-kv eval tasks``): task loading, the run, its result record.

The task YAMLs in ``task_configs/`` read the local files of the shared data folder (:mod:`h2o_kv.harness.data`: PIQA,
OpenBookQA, RTE, MathQA, HellaSwag, LAMBADA) with lm-eval's original prompts and metrics; any folder of user task
YAMLs can be added with ``include_path``. Scoring is lm-eval's, through the model class
:class:`~h2o_kv.eval.lm_eval_model.H2OKVLM` (the protocol is described there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness.data import data_path, sha256
from ..harness.peers import DECODING_PRESSES
from ..harness.setting import KVSetting
from .options import check_options, option_int
from .results import finish_result, item_log_path
from .runner import check_protocol

TASK_CONFIG_DIR = Path(__file__).parent / "task_configs"
DEFAULT_TASKS = ("piqa", "openbookqa", "rte", "mathqa", "hellaswag", "lambada")


def task_manager(include_path: Sequence[str | Path] | str | Path | None = None):
    """lm-eval's TaskManager over h2o-kv's local task YAMLs plus the user's ``include_path`` folders.

    lm-eval's built-in tasks are not indexed: they download their data from the Hugging Face Hub.
    """
    from lm_eval.tasks import TaskManager

    paths = [TASK_CONFIG_DIR]
    if include_path:
        extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
        for path in map(Path, extra):
            if not path.is_dir():
                raise FileNotFoundError(f"--include-path {path} is not a folder of task YAMLs")
        paths += [Path(p) for p in extra]
    return TaskManager(include_path=[str(p) for p in paths], include_defaults=False)


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise ValueError("--tasks is empty; give a comma-separated list, e.g. piqa,openbookqa")
    return list(dict.fromkeys(names))


def _task_files(name: str, manager) -> list[str]:
    """Shared data files read by one of h2o-kv's own task YAMLs (none for a user task)."""
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None or Path(entry.yaml_path).parent.resolve() != TASK_CONFIG_DIR.resolve():
        return []
    return list(TASK_FILES.get(name, []))


TASK_FILES = {
    "piqa": ["piqa/dev.jsonl", "piqa/dev-labels.lst"],
    "openbookqa": ["openbookqa/test.tsv"],
    "rte": ["rte/val.jsonl"],
    "mathqa": ["mathqa/math_qa.jsonl"],
    "hellaswag": ["hellaswag/hellaswag_val_subset1000.jsonl"],
    "lambada": ["lambada/lambada_test.jsonl"],
}


def _quiet() -> None:
    """Silence lm-eval's and datasets' per-task chatter (warnings about custom datasets, map progress bars)."""
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()


def check_tasks(names: Sequence[str], manager) -> dict[str, Any]:
    """Load every task (this reads its data files) so that a bad name or file fails before the model runs."""
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}; available: {', '.join(manager.all_tasks)} "
            "(add a folder of task YAMLs with --include-path)"
        )
    _quiet()
    try:
        return manager.load(list(names))["tasks"]
    except (FileNotFoundError, ValueError):
        raise
    except Exception as err:  # lm-eval wraps YAML and loader errors in assorted types
        raise ValueError(f"cannot load task(s) {', '.join(names)}: {type(err).__name__}: {err}") from err


@dataclass
class TasksJob:
    """Everything ``h2o-kv eval tasks`` needs, validated by :meth:`create` before the model is loaded."""

    tasks: list[str]
    setting: KVSetting
    num_fewshot: int
    limit: int | None
    include_path: list[Path]
    paper_protocol: bool = False
    seed: int = 1234
    manager: Any = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        tasks: str | Sequence[str],
        setting: KVSetting,
        *,
        paper_protocol: bool = False,
        num_fewshot: int = 5,
        limit: int | None = None,
        include_path: Sequence[str | Path] | str | Path | None = None,
        seed: int = 1234,
    ) -> TasksJob:
        """Check the options, the task names and their data files (raises ``ValueError``/``FileNotFoundError``)."""
        check_protocol(setting, paper_protocol)
        if setting.press in DECODING_PRESSES:
            raise ValueError(f"--peer {setting.press} compresses while generating; the lm-eval tasks score given "
                             "continuations: run it on ruler, needle or xsum")  # fmt: skip
        if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
            raise ValueError(f"--num-fewshot must be an integer >= 0, got {num_fewshot!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"--limit must be an integer >= 1, got {limit!r}")
        names = parse_tasks(tasks)
        if include_path is None:
            extra = []
        else:
            extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
        manager = task_manager(extra)
        check_tasks(names, manager)
        return cls(names, setting, num_fewshot, limit, [Path(p) for p in extra], paper_protocol, seed, manager)

    @property
    def label(self) -> str:
        """Report group: results that share it form one table (rows policy, columns budget)."""
        tasks = "" if tuple(self.tasks) == DEFAULT_TASKS else f" {','.join(self.tasks)}"
        limit = "" if self.limit is None else f", limit {self.limit}"
        return f"lm-eval{tasks} {self.num_fewshot}-shot, {self.protocol} protocol{limit}"

    @property
    def protocol(self) -> str:
        return "paper" if self.paper_protocol else "prefill"

    def data(self) -> dict[str, Any]:
        """Checksums of the data files behind the tasks (user tasks: their YAML files)."""
        files: dict[str, str] = {}
        for name in self.tasks:
            relative = _task_files(name, self.manager)
            for item in relative:
                files[item] = sha256(data_path(item))
            entry = self.manager.task_index.get(name)
            if not relative and entry is not None and entry.yaml_path is not None:
                files[str(entry.yaml_path)] = sha256(entry.yaml_path)
        combined = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        return {"name": ",".join(self.tasks), "sha256": combined, "files": files}


def _metric(values: dict[str, Any], name: str) -> float | None:
    value = values.get(f"{name},none")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def run_tasks(
    job: TasksJob,
    model,
    tokenizer,
    json_path: str | Path | None = None,
    *,
    model_name: str,
    progress: Callable[[int], None] | None = None,
    keep_item_log: bool = False,
) -> dict[str, Any]:
    """Run the tasks through lm-eval's ``simple_evaluate`` with :class:`H2OKVLM`; write and return the record.

    ``metrics`` holds ``<task>_acc``, ``<task>_acc_stderr``, ``<task>_acc_norm`` (where lm-eval defines them),
    LAMBADA's ``perplexity``, and ``mean_acc`` over the tasks; ``items`` the per-item accuracies (for paired
    comparisons between settings on the same items). Interrupted runs resume from ``<json>.items.jsonl``.
    """
    from lm_eval import simple_evaluate

    from ..harness.tables import Estimate, average
    from .lm_eval_model import H2OKVLM

    _quiet()
    log_path = item_log_path(json_path) if json_path is not None else None
    lm = H2OKVLM(
        model=model, tokenizer=tokenizer, setting=job.setting, paper_protocol=job.paper_protocol, item_log=log_path,
        model_name=model_name, progress=progress,
    )  # fmt: skip
    start = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = simple_evaluate(
            model=lm, tasks=list(job.tasks), num_fewshot=job.num_fewshot, limit=job.limit,
            task_manager=job.manager, bootstrap_iters=1000, log_samples=True, fewshot_random_seed=job.seed,
            random_seed=job.seed, numpy_random_seed=job.seed, torch_random_seed=job.seed,
        )  # fmt: skip
    elapsed = time.time() - start
    metrics: dict[str, Any] = {}
    per_task: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for name in job.tasks:
        values = out["results"][name]
        row = {"n": int(out["n-samples"][name]["effective"])}
        for metric in ("acc", "acc_norm", "perplexity"):
            value = _metric(values, metric)
            if value is None:
                continue
            row[metric] = value
            stderr = _metric(values, f"{metric}_stderr")
            if stderr is not None:
                row[f"{metric}_stderr"] = stderr
        per_task[name] = row
        metrics.update({f"{name}_{key}": value for key, value in row.items() if key != "n"})
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        items[name] = {
            metric: [float(s[metric]) for s in samples]
            for metric in ("acc", "acc_norm")
            if samples and metric in samples[0]
        }
    accs = [Estimate(row["acc"], row.get("acc_stderr"), row["n"]) for row in per_task.values() if "acc" in row]
    if accs:
        combined = average(accs)
        metrics["mean_acc"] = combined.value
        if combined.se is not None:
            metrics["mean_acc_stderr"] = combined.se
    fields = {
        "protocol": job.protocol,
        "label": job.label,
        "model": model_name,
        "primary_metric": "mean_acc",
        "tasks": per_task,
        "num_fewshot": job.num_fewshot,
        "limit": job.limit,
        "kv_kept_ratio": sum(lm.kept_fraction) / len(lm.kept_fraction) if lm.kept_fraction else None,
        "settings": {
            "tasks": job.tasks,
            "num_fewshot": job.num_fewshot,
            "limit": job.limit,
            "include_path": [str(p) for p in job.include_path],
            "fewshot_seed": job.seed,
            "protocol": job.protocol,
            "budget_of": "context length (heavy = recent = max(1, floor(budget * L / 2)))",
        },
        "data": job.data(),
        "items": items,
        "time_s": round(elapsed, 1),
    }
    return finish_result(
        json_path, "tasks", metrics, fields, setting=job.setting, device=model.device, keep_item_log=keep_item_log
    )


def summary_lines(record: dict[str, Any]) -> list[str]:
    """Per-task lines for the terminal: acc (and acc_norm, perplexity) with standard errors."""
    lines = []
    for name, row in record["tasks"].items():
        parts = [f"{name:<12} n={row['n']:<5}"]
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in row:
                parts.append(f"{metric} {row[metric]:.4f} ± {row.get(metric + '_stderr', float('nan')):.4f}")
        lines.append("  ".join(parts))
    if "mean_acc" in record["metrics"]:
        lines.append(f"mean acc {record['metrics']['mean_acc']:.4f}  ({record['policy']}, budget {record['budget']})")
    return lines


# -- `h2o-kv eval sweep --kind tasks` (registered in h2o_kv.eval.kinds) ---------------------------------------


def sweep_prepare(options: dict[str, Any], models) -> dict[str, Any]:
    check_options("tasks", options, {"tasks", "include_path", "num_fewshot", "limit", "paper_protocol"})
    include = options.get("include_path")
    settings = {
        "tasks": options.get("tasks", ",".join(DEFAULT_TASKS)),
        "num_fewshot": option_int(options, "num_fewshot", 5),
        "limit": option_int(options, "limit"),
        "include_path": None if include in (None, True) else include,
        "paper_protocol": bool(options.get("paper_protocol", False)),
    }
    sweep_job(settings, KVSetting("dynamic"))  # checks the tasks and their data before any cell runs
    return settings


def sweep_job(settings: dict[str, Any], setting: KVSetting) -> TasksJob:
    return TasksJob.create(settings["tasks"], setting, **{k: v for k, v in settings.items() if k != "tasks"})


def sweep_check(settings: dict[str, Any], setting: KVSetting) -> None:
    check_protocol(setting, settings["paper_protocol"])


def sweep_run(settings, setting: KVSetting, path: Path, models, progress) -> dict[str, Any]:
    job = sweep_job(settings, setting)
    return run_tasks(job, models.model(), models.tokenizer(), path, model_name=models.label, progress=progress)
