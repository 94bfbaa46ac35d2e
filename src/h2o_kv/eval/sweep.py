"""Grids of evaluations: every (setting, budget) cell of one kind (:mod:`h2o_kv.eval.kinds`), one result JSON each.

An unbounded setting (``dynamic``, ``full``) runs once, without a budget; every bounded one (h2o-kv policies,
``kvpress:<press>``) at every budget. :func:`run_sweep` skips cells whose JSON already exists, so an interrupted sweep
resumes where it stopped. Each sweep writes its own manifest ``DIR/sweep-<UTC time>.json`` (a ``sweep`` record:
the kind, its options, the grid, the command and provenance); a sweep into a folder whose manifests name another
kind, model or options is refused.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..harness import records
from ..harness.setting import KVSetting, check_name, is_bounded
from .kinds import KINDS
from .runner import ModelHandle


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


def plan_cells(names: list[str], budgets: list[float]) -> list[KVSetting]:
    """The grid's settings: an unbounded setting once, every bounded one at every budget (ratios in (0, 1])."""
    for name in names:
        check_name(name, "--policies")
    for budget in budgets:
        if isinstance(budget, bool) or not 0 < budget <= 1:
            raise ValueError(f"--budgets: {budget!r} is not a ratio in (0, 1]")
    cells = []
    for name in dict.fromkeys(names):
        if is_bounded(name):
            cells += [KVSetting.of(name, budget=float(b)) for b in dict.fromkeys(budgets)]
        else:
            cells.append(KVSetting(name))
    return cells


def cell_name(setting: KVSetting) -> str:
    """``dynamic.json``, ``full.json``, ``h2o_b0.2.json``, ``kvpress_snapkv_b0.2.json``."""
    stem = setting.name.replace(":", "_")
    return f"{stem}.json" if setting.budget is None else f"{stem}_b{setting.budget.ratio:g}.json"


def _manifests(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("sweep-*.json"))]


def run_sweep(
    kind: str,
    names: list[str],
    budgets: list[float],
    out: str | Path,
    options: dict[str, Any],
    models: ModelHandle,
    *,
    console=None,
) -> list[Path]:
    """Run every missing cell of the grid; returns the result paths (finished or skipped)."""
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}; got {kind!r}")
    spec = KINDS[kind]
    cells = plan_cells(names, budgets)
    settings = spec.prepare(dict(options), models)
    for cell in cells:  # every cell is validated before the first one runs
        cell.require_extras("--policies")
        if spec.check_cell is not None:
            spec.check_cell(settings, cell)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    same = {
        "evaluation": kind,
        "model": models.label,
        "options": {k: _canonical(v) for k, v in sorted(options.items())},
    }
    for previous in _manifests(out):
        if {k: previous.get(k) for k in same} != same:
            raise ValueError(
                f"{out} holds a sweep with other settings ({ {k: previous.get(k) for k in same} }); use another --out "
                "or delete that folder"
            )
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    records.write(
        out / f"sweep-{stamp}.json", "sweep", {**same, "settings": names, "budgets": budgets}, h2o_cache=False
    )
    paths = [out / cell_name(cell) for cell in cells]
    todo = [(cell, path) for cell, path in zip(cells, paths, strict=True) if not path.exists()]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        grid = bar.add_task(f"{kind} sweep ({len(cells) - len(todo)} cells done before)", total=len(cells))
        bar.advance(grid, len(cells) - len(todo))
        for cell, path in todo:
            inner = bar.add_task(f"  {path.stem}", total=None)
            spec.run_cell(settings, cell, path, models, lambda n, t=inner: bar.advance(t, n))
            bar.remove_task(inner)
            bar.advance(grid)
    return paths
