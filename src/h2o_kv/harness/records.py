"""Result records: one JSON schema for every result h2o-kv writes (evaluations, bench, profile, ``generate --json``).

A record is a JSON object::

    {"schema": 1, "kind": "ppl" | "tasks" | "xsum" | "needle" | "bench" | "profile" | "generate" | "sweep",
     ...the kind's own fields (the KV setting: "policy", "budget", "heavy", "recent", "bounded", "peer"),
     "metrics": {...},                      # where the kind has metrics
     "command": "h2o-kv eval ppl ...",      # the command as typed (H2O_KV_* variables that were set prefixed)
     "git": {"commit": "<sha>", "dirty": false, "src_tree": "<sha>"} | null,  # the checkout that ran; null: none
     "fused_cpu_kernels": true | false | null,            # null: no H2OCache ran on the CPU
     "versions": {"python", "h2o-kv", "torch", "transformers", and "lm-eval"/"kvpress"/"vllm"/"rouge-score" if used},
     "machine": {"platform", "processor", "cpu_count", "cuda_device"?},
     "created": "2026-...T...+0000"}

``dirty`` is true when ``src/`` of the checkout differs from the commit (modified, staged or untracked files);
``src_tree`` is the git tree id of ``src/`` as it ran (:func:`src_tree`). A
bench file, measured over several invocations, holds ``"runs"`` (one provenance object per invocation) and
``"records"`` (each with ``"run"``: the index of the invocation that measured it).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = 1
OPTIONAL_PACKAGES = {"lm_eval": "lm-eval", "kvpress": "kvpress", "vllm": "vllm", "rouge_score": "rouge-score"}
ENVIRONMENT = ("H2O_KV_FUSED", "H2O_KV_DATA", "H2O_KV_CACHE_DIR")  # variables that change what a command does


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, as typed: ``h2o-kv ...`` for the console script, else
    ``python ...`` (e.g. ``python -m h2o_kv.eval.cli ppl ...``), prefixed by the ``H2O_KV_*`` variables set."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if len(argv) > 1 and Path(argv[1]).name == "h2o-kv":  # python /venv/bin/h2o-kv ...
        words = ["h2o-kv", *argv[2:]]
    elif argv and Path(argv[0]).name == "h2o-kv":
        words = ["h2o-kv", *argv[1:]]
    else:
        words = ["python", *argv[1:]]
    prefix = [f"{name}={shlex.quote(os.environ[name])}" for name in ENVIRONMENT if os.environ.get(name)]
    return " ".join([*prefix, shlex.join(words)])


@lru_cache(maxsize=1)
def git_state() -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the h2o-kv checkout this package runs from; ``None`` for an installed copy."""
    root = Path(__file__).resolve().parents[3]  # src/h2o_kv/harness/records.py -> the checkout
    if not (root / "src" / "h2o_kv").is_dir():
        return None

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    status = git("status", "--porcelain", "--", "src")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "src_tree": src_tree(root),
    }


def src_tree(root: Path) -> str | None:
    """The git tree id of ``src/`` as it is on disk (untracked, not ignored files included), written to a scratch
    object store: equal to ``git rev-parse C:src`` for every commit ``C`` whose sources ran. It proves the code of a
    run whose checkout's ``.git`` is older than its files (a copied working tree, e.g. on a remote GPU machine)."""
    common = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True,
        text=True,
    )
    if common.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        os.mkdir(os.path.join(scratch, "objects"))
        env = {
            **os.environ,
            "GIT_INDEX_FILE": os.path.join(scratch, "index"),
            "GIT_OBJECT_DIRECTORY": os.path.join(scratch, "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(common.stdout.strip(), "objects"),
        }
        for args in (["add", "-A", "--", "src"], ["write-tree", "--prefix=src/"]):
            try:
                out = subprocess.run(
                    ["git", "-C", str(root), *args], capture_output=True, text=True, env=env, timeout=60
                )
            except (OSError, subprocess.TimeoutExpired):
                return None
            if out.returncode != 0:
                return None
    return out.stdout.strip() or None


def versions(packages: tuple[str, ...] = ()) -> dict[str, str]:
    """Python, h2o-kv, torch, transformers, the optional packages this process imported, and ``packages``."""
    import h2o_kv

    found = {"python": platform.python_version(), "h2o-kv": h2o_kv.__version__}
    used = [package for module, package in OPTIONAL_PACKAGES.items() if module in sys.modules]
    for package in ("torch", "transformers", *used, *packages):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name(0)
    return out


def fused_cpu_kernels(device: Any = None, h2o_cache: bool = True) -> bool | None:
    """Whether the fused CPU kernels (:mod:`h2o_kv.kernels`) served the run's H2OCache decode steps: ``None`` when no
    H2OCache ran on the CPU (``device`` not a CPU, or ``h2o_cache`` false), else whether they were usable."""
    if not h2o_cache or device is None or str(device).split(":")[0] != "cpu":
        return None
    from .. import kernels

    return kernels.available()


def provenance(
    *, device: Any = None, h2o_cache: bool = True, command: str | None = None, packages: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Where a result comes from: the command, the code revision, the kernels, versions (plus ``packages``), the
    machine, the time."""
    return {
        "command": command_line() if command is None else command,
        "git": git_state(),
        "fused_cpu_kernels": fused_cpu_kernels(device, h2o_cache),
        "versions": versions(packages),
        "machine": machine(),
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def record(
    kind: str,
    fields: dict[str, Any],
    *,
    device: Any = None,
    h2o_cache: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """A complete record: ``schema``, ``kind``, ``fields`` and the :func:`provenance` of this process."""
    return {"schema": SCHEMA, "kind": kind, **fields, **provenance(device=device, h2o_cache=h2o_cache, command=command)}


def save(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write(path: str | Path, kind: str, fields: dict[str, Any], **options: Any) -> dict[str, Any]:
    """Write one result record to ``path`` (atomically) and return it.

    ``fields``: the kind's own fields (e.g. ``{"policy": ..., "metrics": {...}}``); ``options`` as for
    :func:`record`: ``device`` (the model's device) and ``h2o_cache`` (whether an :class:`~h2o_kv.H2OCache` ran)
    decide ``fused_cpu_kernels``; ``command`` defaults to the command that started this process."""
    data = record(kind, fields, **options)
    save(path, data)
    return data


def bounded(data: dict[str, Any]) -> bool:
    """Whether a result record's KV setting evicts: its ``bounded`` field, or (older records) its setting's name."""
    if "bounded" in data:
        return bool(data["bounded"])
    from .setting import is_bounded

    return is_bounded(str(data.get("policy")))
