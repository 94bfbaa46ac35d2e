"""Running a benchmark grid: alternating order, repeats, a fresh process per measurement, a shared CPU lock,
incremental JSON results (resumable), and the largest batch that fits a KV-memory limit.

A results file is one bench record (:mod:`h2o_kv.harness.records`): ``{"schema", "kind": "bench", "runs": [...],
"records": [...]}``. Every invocation that writes into the file appends its ``run`` (command as typed, code revision,
kernels, versions, machine, the model and options) and each measurement names the run that made it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..harness import records
from ..harness.setting import check_name, is_bounded
from .harness import BenchConfig
from .memory import parse_bytes
from .worker import RESULT_PREFIX

PROBE_NEW_TOKENS = 4
LOCK_YIELD_S = 2.0


@dataclass
class RunSettings:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    repeats: int = 1
    isolate: str = "auto"  # "process" | "none" | "auto" (process on CPU, none on CUDA)
    lock: str | None = None
    warmup: bool = True

    def isolated(self, device_type: str) -> bool:
        if self.isolate not in ("auto", "process", "none"):
            raise ValueError(f"--isolate must be auto, process or none; got {self.isolate!r}")
        return self.isolate == "process" or (self.isolate == "auto" and device_type == "cpu")


class ResultStore:
    """A bench results file, rewritten atomically after every measurement; opening it appends this invocation's
    ``run`` (resume: measurements already in the file are skipped by :func:`run_measurements`)."""

    def __init__(self, path: str | os.PathLike, run: dict):
        self.path = pathlib.Path(path)
        self.data = {"schema": records.SCHEMA, "kind": "bench", "runs": [], "records": []}
        if self.path.is_file():
            old = json.loads(self.path.read_text())
            if old.get("kind") != "bench" or "runs" not in old:
                raise ValueError(f"--out {self.path} is not an h2o-kv bench results file")
            self.data["runs"], self.data["records"] = old["runs"], old["records"]
        self.run = len(self.data["runs"])
        self.data["runs"].append(run)

    @property
    def records(self) -> list[dict]:
        return self.data["records"]

    def done(self, key: str, repeat: int) -> dict | None:
        return next((r for r in self.records if r["key"] == key and r.get("repeat") == repeat), None)

    def add(self, record: dict) -> None:
        record["run"] = self.run
        self.records.append(record)
        self.save()

    def save(self) -> None:
        records.save(self.path, self.data)


@contextlib.contextmanager
def cpu_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (shared with ``flock PATH cmd`` users) for the block."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Executor:
    """Runs one measurement: in a fresh worker process, or in this process with a cached model."""

    def __init__(self, settings: RunSettings):
        self.settings = settings
        self._lm = None

    def device_type(self) -> str:
        from .workload import resolve_device

        return resolve_device(self.settings.device).type

    def request(self, cfg: BenchConfig) -> dict:
        s = self.settings
        return {"model": s.model, "device": s.device, "dtype": s.dtype, "threads": s.threads,
                "warmup": s.warmup, "config": cfg.to_dict()}  # fmt: skip

    def __call__(self, cfg: BenchConfig) -> dict:
        if self.settings.isolated(self.device_type()):
            return self._in_subprocess(cfg)
        return self._in_process(cfg)

    def _in_process(self, cfg: BenchConfig) -> dict:
        from .harness import measure
        from .worker import model_info
        from .workload import load_bench_model

        s = self.settings
        if self._lm is None:
            import torch

            if s.threads:
                torch.set_num_threads(s.threads)
            self._lm = load_bench_model(s.model, device=s.device, dtype=s.dtype)
        result = measure(self._lm, cfg, warmup=s.warmup)
        result.update(model_info(self._lm))
        return result

    def _in_subprocess(self, cfg: BenchConfig) -> dict:
        cmd = [sys.executable, "-m", "h2o_kv.bench.worker", json.dumps(self.request(cfg))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"benchmark worker failed for {cfg.key} (exit {proc.returncode}):\n{tail}")
        result = json.loads(lines[-1][len(RESULT_PREFIX) :])
        result["isolated_process"] = True
        return result


def order_for_repeat(configs: list[BenchConfig], repeat: int) -> list[BenchConfig]:
    """Configurations alternate within a repeat; odd repeats run in reverse so no configuration is always first."""
    return list(configs) if repeat % 2 == 0 else list(reversed(configs))


def run_measurements(
    configs: list[BenchConfig],
    store: ResultStore,
    settings: RunSettings,
    executor: Callable[[BenchConfig], dict] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Measure every configuration ``settings.repeats`` times, skipping those already in ``store``."""
    executor = executor or Executor(settings)
    plan = [(r, cfg) for r in range(settings.repeats) for cfg in order_for_repeat(configs, r)]
    out = []
    for n, (repeat, cfg) in enumerate(plan, 1):
        previous = store.done(cfg.key, repeat)
        if previous is not None:
            out.append(previous)
            continue
        if progress:
            progress(f"[{n}/{len(plan)}] repeat {repeat}: {cfg.key}")
        with cpu_lock(settings.lock):
            result = executor(cfg)
        if settings.lock:
            time.sleep(LOCK_YIELD_S)  # let others waiting on the shared lock take it between measurements
        result["repeat"] = repeat
        result["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        store.add(result)
        out.append(result)
        if progress:
            progress(_summary(result))
    return out


def _summary(r: dict) -> str:
    e2e = f"{r['e2e_tok_s']:.2f}" if r.get("e2e_tok_s") else "-"
    return (
        f"    prefill {r['prefill_s']:.1f}s  decode {r['decode_tok_s']:.2f} tok/s (p50 {r['step_ms_p50']:.0f} ms)  "
        f"e2e {e2e} tok/s  cache {r['cache_bytes_end'] / 2**20:.0f} MiB  "
        f"prefill peak +{r['prefill_peak_increase_bytes'] / 2**20:.0f} MiB"
    )


# -- memory limit --------------------------------------------------------------------------------------------
def parse_limit(text: str) -> tuple[str | None, int]:
    """``--memory-limit``: ``(None, bytes)`` for a size, ``(setting, B)`` for ``SETTING@B`` (what the unbounded
    ``SETTING``, e.g. ``dynamic``, needs at batch ``B`` for the same workload)."""
    text = text.strip()
    if "@" not in text:
        return None, parse_bytes(text)
    name, _, batch = text.partition("@")
    check_name(name, "--memory-limit SETTING@B: SETTING")
    if is_bounded(name):
        raise ValueError(f"--memory-limit {text}: SETTING must keep every entry (dynamic or full), not {name!r}")
    if not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"--memory-limit {text}: B must be a batch size >= 1")
    return name, int(batch)


def footprint_per_sequence(probe: dict, new_tokens: int) -> float:
    """Cache bytes one sequence needs for ``new_tokens`` new tokens, from a batch-1 probe run.

    Bytes after prefill plus the measured growth per decode step times the ``new_tokens - 1`` decode steps (a
    ``DynamicCache`` grows by one entry per step; a bounded H2O cache stops growing after its first eviction).
    """
    steps = probe["decode_steps"]
    growth = max(0.0, (probe["cache_bytes_end"] - probe["cache_bytes_after_prefill"]) / steps)
    peak = max(probe["cache_bytes_peak"], probe["cache_bytes_after_prefill"] + growth * (new_tokens - 1))
    return peak / probe["config"]["batch"]


def fit_runs(
    configs: list[BenchConfig],
    limit: str,
    store: ResultStore,
    settings: RunSettings,
    executor: Callable[[BenchConfig], dict] | None = None,
    progress: Callable[[str], None] | None = None,
    max_batch: int = 256,
) -> list[dict]:
    """For each bounded configuration: the largest batch whose cache fits ``limit``, then run that batch.

    ``limit`` is a size or ``SETTING@B``: the cache bytes the unbounded ``SETTING`` (``dynamic``, ``full``) measured
    at batch ``B`` for the same prompt length and new tokens (measured here first if the store has no such record).
    Results carry ``memory_limit_bytes``, ``fit_batch`` and ``fits`` (the verified run's peak cache bytes are within
    the limit).
    """
    executor = executor or Executor(settings)
    reference_setting, value = parse_limit(limit)
    fitted = []
    seen_groups = set()
    for cfg in configs:
        if not cfg.setting.bounded:
            continue
        group = replace(cfg, batch=1, prefill_batch=None, tag="")
        if group.key in seen_groups:
            continue
        seen_groups.add(group.key)
        if reference_setting is not None:
            reference = replace(cfg, policy=reference_setting, budget=None, heavy=None, recent=None, batch=value,
                                prefill_batch=None, tag="")  # fmt: skip
            runs = run_measurements([reference], store, replace(settings, repeats=1), executor, progress)
            limit_bytes = runs[0]["cache_bytes_peak"]
        else:
            limit_bytes = value
        probe_cfg = replace(group, new_tokens=min(cfg.new_tokens, PROBE_NEW_TOKENS), tag="probe")
        probe = run_measurements([probe_cfg], store, replace(settings, repeats=1), executor, progress)[0]
        per_seq = footprint_per_sequence(probe, cfg.new_tokens)
        batch = min(max_batch, math.floor(limit_bytes / per_seq))
        if batch < 1:
            raise ValueError(f"{cfg.policy}: one sequence needs {per_seq:.0f} cache bytes > limit {limit_bytes}")
        fitted.append((replace(group, batch=batch, tag="fit"), limit_bytes, per_seq))
    results = []
    for fit_cfg, limit_bytes, per_seq in fitted:
        for record in run_measurements([fit_cfg], store, settings, executor, progress):
            record.update(
                memory_limit=limit,
                memory_limit_bytes=limit_bytes,
                fit_batch=fit_cfg.batch,
                footprint_per_seq_bytes=per_seq,
                fits=record["cache_bytes_peak"] <= limit_bytes,
            )
            results.append(record)
        store.save()
    return results


def run_info(settings: RunSettings, grid: list[BenchConfig]) -> dict:
    """This invocation's entry in the results file: :func:`h2o_kv.harness.records.provenance` plus the run's options."""
    from .workload import resolve_device

    device = resolve_device(settings.device)
    packages = ("kvpress",) if any(cfg.setting.press for cfg in grid) else ()
    from ..models import DEFAULT_MODEL

    return {
        **records.provenance(device=device, h2o_cache=any(c.setting.uses_h2o_cache for c in grid), packages=packages),
        "model": settings.model or DEFAULT_MODEL,
        "requested_device": settings.device or "auto",
        "dtype": settings.dtype,
        "threads": settings.threads,
        "repeats": settings.repeats,
        "isolate": settings.isolate,
    }
