"""Watching a running vLLM server: its Prometheus ``/metrics`` and the memory of its process tree, over time.

A :class:`Monitor` thread samples every ``interval`` seconds: the engine's running and waiting requests, the
KV-cache usage (the fraction of KV blocks in use, ``vllm:kv_cache_usage_perc``) and the preemption count, plus the
resident memory (RSS, ``psutil``) summed over the server process and all its children (API server, engine core,
worker). Memory shared between those processes is counted once per process, so the sum is an upper bound.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field

# Prometheus name (without the "vllm:" prefix) -> the short name kept in a sample
METRICS = {
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv_usage",
    "num_preemptions": "preemptions",
}


def scrape(url: str, api_key: str | None = None, timeout: float = 5) -> dict[str, float]:
    """The :data:`METRICS` of one ``/metrics`` page (summed over engines and label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    out = dict.fromkeys(METRICS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("vllm:")
        if name in METRICS:
            for sample in family.samples:
                if sample.name.removeprefix("vllm:") in (name, name + "_total"):
                    out[METRICS[name]] += sample.value
    return out


def tree_rss(pid: int) -> int:
    """Bytes resident in process ``pid`` and all its descendants (0 once it has exited)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class Monitor:
    """Samples ``{t, running, waiting, kv_usage, preemptions, rss}`` of a server until :meth:`stop` (a context
    manager); ``t`` is seconds since the start."""

    base_url: str
    pid: int
    api_key: str | None = None
    interval: float = 0.5
    samples: list[dict] = field(default_factory=list)
    errors: int = 0

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-monitor", daemon=True)
        self._start = time.monotonic()

    def sample(self) -> dict:
        row: dict = {"t": round(time.monotonic() - self._start, 3), "rss": tree_rss(self.pid)}
        try:
            row.update(scrape(self.base_url + "/metrics", self.api_key))
        except OSError:
            self.errors += 1
        self.samples.append(row)
        return row

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> Monitor:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- summaries ---------------------------------------------------------------------------------------------

    def peak(self, key: str) -> float | None:
        values = [row[key] for row in self.samples if key in row]
        return max(values) if values else None

    def mean(self, key: str, *, when=None) -> float | None:
        values = [row[key] for row in self.samples if key in row and (when is None or when(row))]
        return sum(values) / len(values) if values else None

    def timeline(self, keys=("running", "waiting", "kv_usage", "rss")) -> dict[str, list]:
        """Column-wise samples (``t`` plus ``keys``), compact for a result record."""
        rows = [row for row in self.samples if all(key in row for key in keys)]
        return {"t": [row["t"] for row in rows], **{key: [row[key] for row in rows] for key in keys}}
