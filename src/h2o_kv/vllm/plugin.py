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
    from . import blocks

    blocks.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    _cached_get_attn_backend.cache_clear()  # a backend chosen before (an engine without the setting) is forgotten
