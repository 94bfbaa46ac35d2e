"""Fused CPU kernels for the bookkeeping of a decode step (``decode_step.cpp``), compiled on first use.

On a CPU, the bookkeeping of an H2O decode step is a handful of tiny tensor ops per layer (scatters into the slot
buffer, the score update, the recent-window mask, the minimum), each re-reading small tensors that the layer's
weights have pushed out of the caches: dispatch and cold reads, not arithmetic, make it cost ~10% of a step. The
kernels here do the same work in one pass per step part: :func:`cpu_ops` returns them (built once with
``torch.utils.cpp_extension``, about 30 s, cached under ``$H2O_KV_CACHE_DIR/kernels``) or ``None`` when they
cannot be used, and the callers then run the equivalent torch ops (the tests check both agree). Set
``H2O_KV_FUSED=0`` to turn them off.

:func:`quant_ops` (``quant_attend.cpp``, the same build and switch) is the decode attention over quantized slots
(``H2OCache(kv_bits=...)``): it reads the 4/8-bit codes in place instead of dequantizing blocks of them first.
:func:`paged_ops` (``paged_decode.cpp``) is the vLLM backend's decode step of bounded requests: write, attention,
mass and H2O's eviction in one pass over each request's paged slots (:mod:`h2o_kv.vllm.attention`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import platform
import shutil
import sys
import threading
import time
import warnings

import torch

_SOURCE = pathlib.Path(__file__).with_name("decode_step.cpp")
_QUANT_SOURCE = pathlib.Path(__file__).with_name("quant_attend.cpp")
_PAGED_SOURCE = pathlib.Path(__file__).with_name("paged_decode.cpp")
# OpenMP for at::parallel_for over rows and `omp simd` loops, built for this CPU's vector units
_SIMD = {"extra_cflags": ["-O3", "-fopenmp", "-march=native", "-fno-math-errno"], "extra_ldflags": ["-fopenmp"]}
_FLAGS = {_SOURCE: {"extra_cflags": ["-O3"]}, _QUANT_SOURCE: _SIMD, _PAGED_SOURCE: _SIMD}
_loaded: dict[pathlib.Path, object] = {}
_build_lock = threading.Lock()


def enabled() -> bool:
    """False when ``H2O_KV_FUSED`` is set to ``0``/``false``/``no``/``off``."""
    return os.environ.get("H2O_KV_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
    """Build or load the kernels now (the build runs once per machine, a load takes ~0.1 s); False if unusable."""
    return cpu_ops(torch.zeros(1)) is not None


def cpu_ops(*tensors: torch.Tensor):
    """The compiled kernels when they apply to ``tensors`` (all on the CPU and contiguous), else ``None``."""
    return _ops(_SOURCE, tensors)


def quant_ops(*tensors: torch.Tensor):
    """The compiled quantized decode attention when it applies to ``tensors`` (CPU, contiguous), else ``None``."""
    return _ops(_QUANT_SOURCE, tensors)


def paged_ops():
    """The compiled decode step of the vLLM backend (``paged_decode.cpp``), or ``None`` (no compiler, or off)."""
    return _ops(_PAGED_SOURCE, ())


def _ops(source: pathlib.Path, tensors):
    """``source``'s module, built or loaded once per process (``None``: off, unbuildable, or not for ``tensors``)."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    if source not in _loaded:
        with _build_lock:
            if source not in _loaded:
                _loaded[source] = _build(source) if enabled() else None
    return _loaded[source]


def _build(source: pathlib.Path = _SOURCE):
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its environment's bin is not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    flags = _FLAGS[source]
    native = platform.processor() + _cpu_model() if "-march=native" in flags["extra_cflags"] else ""  # CPU-specific
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # simd.h
    key = source.read_bytes() + headers + torch.__version__.encode() + repr(flags).encode() + native.encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    root = pathlib.Path(os.environ.get("H2O_KV_CACHE_DIR") or "~/.cache/h2o-kv").expanduser()
    build_dir = root / "kernels" / f"{source.stem}-{digest}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(build_dir / "lock")
        if not any(build_dir.glob("*.so")):
            print("h2o-kv: compiling the fused CPU decode kernels (once, about 30 s)...", file=sys.stderr, flush=True)
        return load(
            name=f"h2o_kv_{source.stem}_{digest}",
            sources=[str(source)],
            **flags,
            build_directory=str(build_dir),
        )
    except Exception as error:  # no compiler, no ninja, ...: correct but slower torch ops
        warnings.warn(
            f"h2o-kv: the fused CPU decode kernels could not be built ({type(error).__name__}: {error}); "
            "decode bookkeeping falls back to torch ops (same results, slower). It needs a C++ compiler and "
            "ninja on PATH; set H2O_KV_FUSED=0 to silence this.",
            stacklevel=2,
        )
        return None


def _cpu_model() -> str:
    """The CPU's model name (Linux), so a ``-march=native`` build is never loaded on another kind of CPU."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


STALE_LOCK_S = 600  # a build takes well under a minute; an older lock was left by a process killed while building


def _clear_stale_lock(lock: pathlib.Path) -> None:
    """Remove the build lock of a process killed mid-build (torch would otherwise wait for it forever)."""
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            print(f"h2o-kv: removed a stale kernel build lock ({lock})", file=sys.stderr, flush=True)
