"""Grids of evaluations: every (policy, budget) cell of one kind of evaluation, one result JSON per cell.

A kind of evaluation plugs in by name (:data:`KINDS`, :func:`register_kind`) as a :class:`SweepKind`:

* ``prepare(options, models) -> settings``: validate the kind's own options (strings as typed on the command
  line, e.g. ``{"text": "book.txt", "tokens": "4096", "strip_gutenberg": True}``) and every cell's
  (policy, budget) *before* anything slow happens; raise ``ValueError`` naming the bad option.
* ``check_cell(settings, policy, budget)`` (optional): raise ``ValueError`` if that cell cannot run (e.g. a
  budget that keeps no entry); called for every cell before the first one runs.
* ``run_cell(settings, policy, budget, json_path, models, progress) -> record``: run one cell and write its
  result JSON (:func:`h2o_kv.eval.results.write_result`) to ``json_path``; ``progress(n)`` may be called to
  advance the cell's progress bar by ``n`` units (tokens, items).

:func:`run_sweep` skips cells whose JSON already exists, so an interrupted sweep resumes where it stopped;
``DIR/sweep.json`` remembers the kind and its options and a resume with other options is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..policies import POLICIES


class ModelHandle:
    """Loads the model (and its tokenizer) once, on first use; the tokenizer alone is cheap to get."""

    def __init__(self, name: str | None = None, dtype: str | None = None, device: str | None = None):
        self.name, self.dtype, self.device = name, dtype, device
        self._model = self._tokenizer = None

    @property
    def label(self) -> str:
        from ..models import DEFAULT_MODEL

        return self.name or DEFAULT_MODEL

    def tokenizer(self):
        if self._tokenizer is None:
            if self._model is not None:
                raise RuntimeError(f"model {self.label} has no tokenizer")
            from transformers import AutoTokenizer

            from .. import models

            if self.name is None or self.name == models.DEFAULT_MODEL:
                path = models._ensure_default_model()
            else:
                path = models._resolve_local(self.name)
            if not any((path / f).is_file() for f in models._TOKENIZER_FILES):
                raise ValueError(f"--model {self.label}: no tokenizer files in {path}")
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return self._tokenizer

    def model(self):
        if self._model is None:
            from ..models import load_model

            self._model, tokenizer = load_model(self.name, dtype=self.dtype, device=self.device)
            self._tokenizer = self._tokenizer or tokenizer
        return self._model


Progress = Callable[[int], None]


@dataclass(frozen=True)
class SweepKind:
    """One kind of evaluation that a sweep can run (see the module docstring)."""

    name: str
    prepare: Callable[[dict[str, Any], ModelHandle], Any]
    run_cell: Callable[[Any, str, float, Path, ModelHandle, Progress | None], dict[str, Any]]
    check_cell: Callable[[Any, str, float], None] | None = None
    help: str = ""


KINDS: dict[str, SweepKind] = {}


def register_kind(kind: SweepKind) -> SweepKind:
    KINDS[kind.name] = kind
    return kind


def _canonical(value: Any) -> Any:
    """An option naming an existing file as its absolute path, so ``../data/x`` and ``/abs/data/x`` agree."""
    if isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value


def parse_list(value: str, what: str, convert: Callable[[str], Any] = str) -> list[Any]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    try:
        return [convert(v) for v in items]
    except ValueError:
        raise ValueError(f"--{what}: cannot read {value!r} as a comma-separated list") from None


def parse_options(args: list[str]) -> dict[str, Any]:
    """``["--text", "a.txt", "--strip-gutenberg", "--tokens=4096"]`` -> ``{"text": "a.txt",
    "strip_gutenberg": True, "tokens": "4096"}`` (the kind's own options, passed through the sweep command)."""
    options: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}: kind options are written --name value or --flag")
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if eq:
            options[key] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            options[key] = args[i + 1]
            i += 1
        else:
            options[key] = True
        i += 1
    return options


def cell_name(policy: str, budget: float) -> str:
    return "full.json" if policy == "full" else f"{policy}_b{budget:g}.json"


def plan_cells(policies: list[str], budgets: list[float]) -> list[tuple[str, float]]:
    """The (policy, budget) cells: ``full`` once (budget 1), every other policy at every budget."""
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"--policies: {policy!r} is not one of {', '.join(POLICIES)}")
    for budget in budgets:
        if isinstance(budget, bool) or not 0 < budget <= 1:
            raise ValueError(f"--budgets: {budget!r} is not a ratio in (0, 1]")
    cells = []
    for policy in dict.fromkeys(policies):
        cells += [("full", 1.0)] if policy == "full" else [(policy, float(b)) for b in dict.fromkeys(budgets)]
    return cells


def run_sweep(
    kind: str,
    policies: list[str],
    budgets: list[float],
    out: str | Path,
    options: dict[str, Any],
    models: ModelHandle,
    *,
    command: str | None = None,
    console=None,
) -> list[Path]:
    """Run every missing cell of the grid; returns the result paths (finished or skipped).

    ``command`` (the sweep's command line) is added to every new result file, for the report's "regenerate"."""
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}; got {kind!r}")
    spec = KINDS[kind]
    cells = plan_cells(policies, budgets)
    settings = spec.prepare(dict(options), models)
    if spec.check_cell is not None:
        for policy, budget in cells:  # every cell is validated before the first one runs
            spec.check_cell(settings, policy, budget)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"kind": kind, "model": models.label, "options": {k: _canonical(v) for k, v in sorted(options.items())}}
    manifest_path = out / "sweep.json"
    if manifest_path.exists():
        previous = json.loads(manifest_path.read_text())
        if {k: previous.get(k) for k in manifest} != manifest:
            raise ValueError(
                f"{out} holds a sweep with other settings ({previous}); use another --out or delete that folder"
            )
    manifest_path.write_text(json.dumps({**manifest, "policies": policies, "budgets": budgets}, indent=2) + "\n")
    paths = [out / cell_name(p, b) for p, b in cells]
    todo = [(cell, path) for cell, path in zip(cells, paths, strict=True) if not path.exists()]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        grid = bar.add_task(f"{kind} sweep ({len(cells) - len(todo)} cells done before)", total=len(cells))
        bar.advance(grid, len(cells) - len(todo))
        for (policy, budget), path in todo:
            inner = bar.add_task(f"  {path.stem}", total=None)
            spec.run_cell(settings, policy, budget, path, models, lambda n, t=inner: bar.advance(t, n))
            if command is not None and path.exists():
                record = json.loads(path.read_text())
                if "command" not in record:
                    tmp = path.with_suffix(".json.tmp")
                    tmp.write_text(json.dumps({**record, "command": command}, indent=2) + "\n")
                    tmp.replace(path)
            bar.remove_task(inner)
            bar.advance(grid)
    return paths


# -- the perplexity kind ---------------------------------------------------------------------------------------


def _int_option(options: dict[str, Any], name: str, default=None) -> int | None:
    value = options.get(name, default)
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{name.replace('_', '-')} must be an integer, got {value!r}") from None


_PPL_OPTIONS = {"text", "tokens", "strip_gutenberg", "streaming", "window", "chunk"}


def _ppl_prepare(options: dict[str, Any], models: ModelHandle):
    from .ppl import PPLJob

    unknown = set(options) - _PPL_OPTIONS
    if unknown:
        raise ValueError(f"--kind ppl does not take {', '.join('--' + u.replace('_', '-') for u in sorted(unknown))}")
    if "text" not in options or options["text"] is True:
        raise ValueError("--kind ppl needs --text FILE")
    if "tokens" not in options:
        raise ValueError("--kind ppl needs --tokens N")
    common = dict(
        text=options["text"],
        tokens=_int_option(options, "tokens"),
        gutenberg=bool(options.get("strip_gutenberg", False)),
        streaming=bool(options.get("streaming", False)),
        window=_int_option(options, "window"),
        chunk=_int_option(options, "chunk", 512),
    )
    job = PPLJob.create(policy="local", heavy=0, recent=1, **common)  # the cells' policies: check_cell
    job.token_ids(models.tokenizer())  # --tokens larger than the text fails here, before the model loads
    return common


def _ppl_job(settings, policy: str, budget: float):
    from .ppl import PPLJob

    return PPLJob.create(policy=policy, budget=None if policy == "full" else budget, **settings)


def _ppl_run_cell(settings, policy: str, budget: float, path: Path, models: ModelHandle, progress):
    from .ppl import run_ppl

    job = _ppl_job(settings, policy, budget)
    return run_ppl(job, models.model(), models.tokenizer(), path, model_name=models.label, progress=progress)


register_kind(SweepKind("ppl", _ppl_prepare, _ppl_run_cell, _ppl_job, "streaming perplexity (h2o-kv eval ppl)"))

# Kinds defined next to their evaluations register themselves on import.
from . import needle, tasks, xsum  # noqa: E402, F401
