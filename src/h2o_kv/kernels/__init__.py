"""Fused CPU kernels for the bookkeeping of a decode step (``decode_step.cpp``), compiled on first use.

On a CPU, the bookkeeping of an H2O decode step is a handful of tiny tensor ops per layer (scatters into the slot
buffer, the score update, the recent-window mask, the minimum), each re-reading small tensors that the layer's
weights have pushed out of the caches: dispatch and cold reads, not arithmetic, make it cost ~10% of a step. The
kernels here do the same work in one pass per step part: :func:`cpu_ops` returns them (built with
``torch.utils.cpp_extension`` once per :func:`build_key` - source, torch install, compiler, flags, python - in
45-110 s, cached under ``$H2O_KV_CACHE_DIR/kernels``) or ``None`` when they cannot be used, and the callers then
run the equivalent torch ops (the tests check both agree). Set ``H2O_KV_FUSED=0`` to turn them off.

:func:`quant_ops` (``quant_attend.cpp``, the same build and switch) is the decode attention over quantized slots
(``H2OCache(kv_bits=...)``): it reads the 4/8-bit codes in place instead of dequantizing blocks of them first.
:func:`paged_ops` (``paged_decode.cpp``) is the vLLM backend's decode step of bounded requests: write, attention,
mass and H2O's eviction in one pass over each request's paged slots (:mod:`h2o_kv.vllm.attention`);
:func:`prefill_ops` (``paged_prefill.cpp``) its prompt chunks: output and per-key mass in one pass.
:func:`step_ops` is what ``H2OCache`` calls: :func:`cpu_ops` on the CPU, the same calls as Triton kernels on CUDA
(:mod:`h2o_kv.kernels.triton`, the optional ``gpu`` extra).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings

import torch

_SOURCE = pathlib.Path(__file__).parent / "cpu" / "decode_step.cpp"
_QUANT_SOURCE = pathlib.Path(__file__).parent / "cpu" / "quant_attend.cpp"
_PAGED_SOURCE = pathlib.Path(__file__).parent / "cpu" / "paged_decode.cpp"
_PREFILL_SOURCE = pathlib.Path(__file__).parent / "cpu" / "paged_prefill.cpp"
# OpenMP for at::parallel_for over rows and `omp simd` loops, built for this CPU's vector units
_SIMD = {"extra_cflags": ["-O3", "-fopenmp", "-march=native", "-fno-math-errno"], "extra_ldflags": ["-fopenmp"]}
_FLAGS = {_SOURCE: {"extra_cflags": ["-O3"]}, _QUANT_SOURCE: _SIMD, _PAGED_SOURCE: _SIMD}
# paged_prefill: no trapping math, so that the softmax's exp vectorizes (its selects may evaluate both arms)
_FLAGS[_PREFILL_SOURCE] = {**_SIMD, "extra_cflags": [*_SIMD["extra_cflags"], "-fno-trapping-math"]}
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


def step_ops(*tensors: torch.Tensor):
    """:func:`cpu_ops` for CPU tensors; for CUDA tensors the Triton kernels of the same calls
    (:mod:`h2o_kv.kernels.triton.slots`, the ``gpu`` extra); ``None`` where neither applies or ``H2O_KV_FUSED=0``."""
    if tensors and _device_type(tensors[0]) == "cuda":
        from .triton import slot_ops

        return slot_ops(tensors) if enabled() else None
    return cpu_ops(*tensors)


def _device_type(tensor: torch.Tensor) -> str:
    return tensor.device.type


def quant_ops(*tensors: torch.Tensor):
    """The compiled quantized decode attention when it applies to ``tensors`` (CPU, contiguous), else ``None``."""
    return _ops(_QUANT_SOURCE, tensors)


def paged_ops():
    """The compiled decode step of the vLLM backend (``paged_decode.cpp``), or ``None`` (no compiler, or off)."""
    return _ops(_PAGED_SOURCE, ())


def prefill_ops():
    """The compiled prompt-chunk attention with mass of the vLLM backend (``paged_prefill.cpp``), or ``None``."""
    return _ops(_PREFILL_SOURCE, ())


def _ops(source: pathlib.Path, tensors):
    """``source``'s module, built or loaded once per process (``None``: off, unbuildable, or not for ``tensors``)."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    if source not in _loaded:
        with _build_lock:
            if source not in _loaded:
                _loaded[source] = _build(source) if enabled() else None
    return _loaded[source]


# Build time on this project's shared 2-core CPU (under load): decode_step 49 s and paged_prefill 45 s (ninja's
# logs), paged_decode 106.8 s (issue 26); quant_attend is the size of paged_prefill. A build records its own time,
# and a later build of the same kernel (another environment) quotes the slowest recorded one.
_BUILD_S = {"decode_step": 50, "quant_attend": 60, "paged_decode": 110, "paged_prefill": 50}


def build_key(source: pathlib.Path = _SOURCE) -> dict[str, str]:
    """What a build of ``source`` depends on; each distinct key builds once, into its own directory.

    The torch install path is part of it because the build command holds that environment's include paths (two
    virtual environments with the same torch version would otherwise rebuild each other's build in turn).
    """
    flags = _FLAGS[source]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # simd.h
    compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension runs
    key = {
        "source": hashlib.sha256(source.read_bytes() + headers).hexdigest()[:16],
        "torch": f"{torch.__version__} at {pathlib.Path(torch.__file__).parent}",
        "compiler": f"{compiler}: {_compiler_version(compiler)}",
        "flags": repr(flags),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }
    if "-march=native" in flags["extra_cflags"]:  # CPU-specific code: never loaded on another kind of CPU
        key["cpu"] = platform.processor() + _cpu_model()
    return key


def build_dir(source: pathlib.Path = _SOURCE, key: dict[str, str] | None = None) -> pathlib.Path:
    """The build directory of ``key`` (default: this environment's), under ``$H2O_KV_CACHE_DIR/kernels``."""
    key = build_key(source) if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = pathlib.Path(os.environ.get("H2O_KV_CACHE_DIR") or "~/.cache/h2o-kv").expanduser()
    return root / "kernels" / f"{source.stem}-{digest}"


def _build(source: pathlib.Path = _SOURCE):
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its environment's bin is not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    key = build_key(source)
    directory = build_dir(source, key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory / "lock")
        fresh = not any(directory.glob("*.so"))
        if fresh:
            print(f"h2o-kv: building the {source.stem} kernel ({_why(directory, key)}; about {_estimate(directory)} s, "
                  f"once per environment) into {directory}", file=sys.stderr, flush=True)  # fmt: skip
            (directory / "key.json").write_text(json.dumps(key, indent=1) + "\n")
        start = time.perf_counter()
        module = load(name=f"h2o_kv_{source.stem}_{directory.name.rsplit('-', 1)[1]}", sources=[str(source)],
                      **_FLAGS[source], build_directory=str(directory))  # fmt: skip
        if fresh:
            seconds = time.perf_counter() - start
            (directory / "build_s").write_text(f"{seconds:.1f}\n")
            print(f"h2o-kv: built the {source.stem} kernel in {seconds:.0f} s", file=sys.stderr, flush=True)
        return module
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


def _compiler_version(compiler: str) -> str:
    """The first line of ``compiler --version`` (``not found`` when it does not run: the build then fails)."""
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "not found"
    return (run.stdout.splitlines() or ["unknown"])[0].strip()


def _why(directory: pathlib.Path, key: dict[str, str]) -> str:
    """Why ``directory`` is built: no earlier build of this kernel here, or which parts of the key differ."""
    earlier = [p for p in _siblings(directory, "key.json") if p.parent != directory]
    if not earlier:
        return "no earlier build of it in this cache"
    latest = max(earlier, key=lambda p: p.stat().st_mtime)
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(latest.read_text())
        changed = [name for name in key if old.get(name) != key[name]] or ["an unfinished build"]
        return f"new build key: {', '.join(changed)} changed since {latest.parent.name}"
    return "new build key"


def _estimate(directory: pathlib.Path) -> int:
    """Seconds a build of this kernel takes here: the slowest recorded earlier build, else :data:`_BUILD_S`."""
    recorded = []
    for path in _siblings(directory, "build_s"):
        with contextlib.suppress(OSError, ValueError):
            recorded.append(float(path.read_text()))
    return round(max(recorded, default=_BUILD_S.get(directory.name.rsplit("-", 1)[0], 60)))


def _siblings(directory: pathlib.Path, name: str) -> list[pathlib.Path]:
    """``name`` in every build directory of the same kernel (any key)."""
    return list(directory.parent.glob(f"{directory.name.rsplit('-', 1)[0]}-*/{name}"))


STALE_LOCK_S = 600  # a build takes under two minutes; an older lock was left by a process killed while building


def _clear_stale_lock(lock: pathlib.Path) -> None:
    """Remove the build lock of a process killed mid-build (torch would otherwise wait for it forever)."""
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            print(f"h2o-kv: removed a stale kernel build lock ({lock})", file=sys.stderr, flush=True)
