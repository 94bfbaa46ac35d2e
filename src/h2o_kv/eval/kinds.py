"""The kinds of evaluation a sweep can run, registered explicitly in one place (:data:`KINDS`).

A kind is a :class:`Kind`: ``prepare(options, models) -> settings`` validates the kind's own options (strings as
typed on the command line, e.g. ``{"text": "book.txt", "tokens": "4096", "strip_gutenberg": True}``) before
anything slow happens and raises ``ValueError`` naming the bad option; ``check_cell(settings, setting)`` (optional)
raises if one cell's :class:`~h2o_kv.harness.setting.KVSetting`
cannot run (called for every cell before the first runs);
``run_cell(settings, setting, json_path, models, progress) -> record`` runs one cell and writes its result JSON
(``progress(n)`` advances the cell's progress bar by ``n`` tokens or items).

A new kind of evaluation is one module with those three functions and one line below (:func:`register_kind` adds a
kind at run time, e.g. from a user's own code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import needle, ppl, ruler, tasks, xsum

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Kind:
    """One kind of evaluation that a sweep can run (see the module docstring)."""

    name: str
    prepare: Callable[[dict[str, Any], Any], Any]
    run_cell: Callable[[Any, Any, Path, Any, Progress | None], dict[str, Any]]
    check_cell: Callable[[Any, Any], None] | None = None
    help: str = ""


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("ppl", ppl.sweep_prepare, ppl.sweep_run, ppl.sweep_check, "streaming perplexity (h2o-kv eval ppl)"),
        Kind("tasks", tasks.sweep_prepare, tasks.sweep_run, tasks.sweep_check, "lm-eval tasks (h2o-kv eval tasks)"),
        Kind("xsum", xsum.sweep_prepare, xsum.sweep_run, None, "XSUM ROUGE (h2o-kv eval xsum)"),
        Kind("needle", needle.sweep_prepare, needle.sweep_run, None, "needle in a haystack (h2o-kv eval needle)"),
        Kind("ruler", ruler.sweep_prepare, ruler.sweep_run, None, "RULER-style synthetic suite (h2o-kv eval ruler)"),
    )
}


def register_kind(kind: Kind) -> Kind:
    """Add (or replace) a kind at run time."""
    KINDS[kind.name] = kind
    return kind
