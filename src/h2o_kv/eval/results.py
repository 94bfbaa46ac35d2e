"""Finishing an evaluation run: its result record (:mod:`h2o_kv.harness.records`) and the item log that makes it
resumable.

Per-item progress goes to a JSONL file next to the result JSON (:class:`ItemLog`), so an interrupted run resumes
without redoing finished items; the log is deleted once the result is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..harness import records
from ..harness.setting import KVSetting


def item_log_path(json_path: str | Path) -> Path:
    """The item log of the run that writes ``json_path``: ``<stem>.items.jsonl`` next to it."""
    path = Path(json_path)
    return path.with_name(path.stem + ".items.jsonl")


def finish_result(
    json_path: str | Path | None,
    kind: str,
    metrics: dict[str, Any],
    fields: dict[str, Any],
    *,
    setting: KVSetting,
    device: Any,
    keep_item_log: bool = False,
) -> dict[str, Any]:
    """The record of a finished run under ``setting`` on ``device``: written to ``json_path`` (then the run's item log
    is deleted unless ``keep_item_log``), or only returned when there is no path."""
    fields = {**setting.fields(), **fields, "metrics": metrics}
    options = dict(device=device, h2o_cache=setting.uses_h2o_cache)
    if json_path is None:
        return records.record(kind, fields, **options)
    record = records.write(json_path, kind, fields, **options)
    if not keep_item_log:
        item_log_path(json_path).unlink(missing_ok=True)
    return record


class ItemLog:
    """Append-only JSONL of finished items keyed by ``key``: lets a long run resume where it stopped."""

    def __init__(self, path: str | Path, settings: dict[str, Any]):
        self.path = Path(path)
        self.settings = settings
        self.done: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if lines and lines[0].get("settings") != settings:
                raise ValueError(
                    f"{self.path} holds a run with other settings; delete it or choose another --json path"
                )
            self.done = {row["key"]: row for row in lines[1:]}
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": settings}) + "\n")

    def __contains__(self, key: str) -> bool:
        return key in self.done

    def add(self, key: str, **row: Any) -> None:
        row = {"key": key, **row}
        self.done[key] = row
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
