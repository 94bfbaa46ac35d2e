"""Memory measurement: peak process RSS (CPU), peak allocated memory (CUDA), and bytes held by a KV cache.

On Linux the RSS high-water mark (``VmHWM``) is reset by writing ``5`` to ``/proc/self/clear_refs``, so the
peak of one phase (prefill, decode) is read exactly, without sampling. Freed heap memory is first handed back to
the OS (``malloc_trim``) so that pages cached by the allocator from an earlier phase do not hide a new peak. Where
the reset is not possible a sampling thread (1 ms) is used instead, and the result says which method ran.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time

import torch

_PROC_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_PROC_STATUS) as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # best effort off Linux


def trim_heap() -> None:
    """Return freed heap pages to the OS (glibc only; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


class PeakMemory:
    """Context manager: peak memory of the block, absolute and above the level at its start.

    ``device.type == "cuda"``: ``torch.cuda.max_memory_allocated`` (tensors only). Otherwise the process RSS
    (weights, activations, cache and allocator overhead together).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""
        self.start = self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            self.method = "cuda_max_memory_allocated"
            return self
        trim_heap()
        self.start = current_rss()
        if _reset_hwm():
            self.method = "rss_hwm"
            return self
        self.method = "rss_sampled_1ms"
        self._peak_sampled = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak_sampled = max(self._peak_sampled, current_rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "rss_hwm":
            self.peak = max(self.start, (_status_kib("VmHWM") or 0) * 1024)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._peak_sampled, current_rss())

    @property
    def increase(self) -> int:
        return self.peak - self.start


def _nbytes(t) -> int:
    from ..hf.quant import stored_bytes

    return stored_bytes(t)


def cache_bytes(cache) -> tuple[int, int]:
    """``(kv_bytes, total_bytes)`` held by a cache: key/value storage, and that plus bookkeeping tensors.

    For an :class:`~h2o_kv.H2OCache` the bookkeeping is the per-slot position, validity and score; allocated slots
    count whether or not they currently hold an entry (that memory is taken).
    """
    kv = total = 0
    for layer in getattr(cache, "layers", []):
        if not getattr(layer, "is_initialized", True):
            continue
        names = ("keys", "values", "_quantized_keys", "_quantized_values")  # the last two: transformers' QuantizedCache
        layer_kv = sum(_nbytes(getattr(layer, name, None)) for name in names)
        kv += layer_kv
        total += layer_kv + sum(_nbytes(getattr(layer, name, None)) for name in ("pos", "valid", "scores", "start"))
    return kv, total


def parse_bytes(text: str) -> int:
    """``"377MB"``, ``"1.5GiB"``, ``"400000000"`` -> bytes (decimal kB/MB/GB, binary KiB/MiB/GiB)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"--memory-limit: expected a size like 377MB, 1.5GiB or dynamic@4; got {text!r}")
    value = float(match.group(1)) * units[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"--memory-limit must be > 0, got {text!r}")
    return int(value)
