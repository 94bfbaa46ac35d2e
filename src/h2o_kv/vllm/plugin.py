"""The ``vllm.general_plugins`` entry point: H2O eviction inside vLLM, switched on by :data:`~.config.ENV`.

vLLM calls :func:`register` in each of its processes (API server, engine core, worker). Without a setting in the
environment it changes nothing. With one it checks the vLLM version, selects vLLM's V1 model runner (the one
:mod:`h2o_kv.vllm.patches` patches; unset, vLLM warns in every process that V2 needs Triton), applies the patches,
registers the bounded requests' KV-cache spec and block manager (:mod:`h2o_kv.vllm.blocks`) and makes
:class:`h2o_kv.vllm.attention.H2OAttentionBackend` the backend vLLM picks for ``CPU_ATTN``.
"""

from __future__ import annotations

import os

from .config import ServeConfig

BACKEND = "h2o_kv.vllm.attention.H2OAttentionBackend"
RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def register() -> None:
    if ServeConfig.from_env() is None:  # raises ValueError naming the variable when it is malformed
        return
    if os.environ.setdefault(RUNNER, "0").strip().lower() not in ("0", "false"):
        raise ValueError(f"h2o-kv's vLLM plugin patches vLLM's V1 model runner: unset {RUNNER} or set it to 0")
    from . import patches

    patches.install()  # refuses an untested vLLM first
    fix_mmap_threshold()
    from . import blocks

    blocks.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    _cached_get_attn_backend.cache_clear()  # a backend chosen before (an engine without the setting) is forgotten


MMAP_THRESHOLD = 128 * 1024  # bytes
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 128 KiB in this process (``mallopt``); False where the C library is not glibc.

    glibc raises the threshold each time a large block is freed (up to 32 MiB); from then on a prefill's
    activations, of a different size for every prompt, come from the heap and fragment it, and a long-running
    worker's RSS creeps up (+7% in a 5-minute soak of 64 clients). A fixed threshold keeps every block of 128 KiB or
    more mmapped, returned to the system when freed. Done here, at the plugin's start in each vLLM process, because
    vLLM starts its engine and worker processes with an environment of its own, which drops ``MALLOC_*`` variables.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to fix
        return False
