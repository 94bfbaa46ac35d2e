"""Result files shared by every evaluation: one JSON per run, with settings, versions and data checksums.

Every evaluation writes ``{"kind", "policy", "heavy", "recent", "budget", "model", "metrics", "settings",
"data", "versions", "created"}``; per-item progress goes to a JSONL file next to it so an interrupted run
resumes without redoing finished items (:class:`ItemLog`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def _find_shared_data() -> Path:
    if os.environ.get("H2O_KV_DATA"):
        return Path(os.environ["H2O_KV_DATA"])
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):  # the repo (editable install), or cwd
        if (root.parent / "shared" / "data").is_dir():
            return root.parent / "shared" / "data"
    return Path.cwd().parent / "shared" / "data"


SHARED_DATA = _find_shared_data()


def data_path(relative: str) -> Path:
    """Path of a file in the shared data folder (``$H2O_KV_DATA`` or ``../shared/data`` next to the repo)."""
    path = SHARED_DATA / relative
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (set H2O_KV_DATA to the folder holding MANIFEST.md)")
    return path


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "machine": f"{platform.machine()} {os.cpu_count()} cpus"}
    for package in ("h2o-kv", "torch", "transformers", "lm_eval", "kvpress", "rouge-score"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def write_result(path: str | Path, kind: str, metrics: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Write one result JSON (atomically) and return it."""
    record = {
        "kind": kind,
        **fields,
        "metrics": metrics,
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return record


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
    keep_item_log: bool = False,
) -> dict[str, Any]:
    """The record of a finished run: written to ``json_path`` (:func:`write_result`), after which the run's item
    log is deleted unless ``keep_item_log``; without a path, returned unwritten (no ``created`` stamp)."""
    if json_path is None:
        return {"kind": kind, **fields, "metrics": metrics, "versions": versions()}
    record = write_result(json_path, kind, metrics, **fields)
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
