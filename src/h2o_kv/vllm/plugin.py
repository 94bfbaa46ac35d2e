"""The ``vllm.general_plugins`` entry point: H2O eviction inside vLLM, switched on by :data:`~.config.ENV`.

vLLM calls :func:`register` in each of its processes (API server, engine core, worker). Without a setting in the
environment it changes nothing. With one it checks the vLLM version, applies :mod:`h2o_kv.vllm.patches` and makes
:class:`h2o_kv.vllm.attention.H2OAttentionBackend` the backend vLLM picks for ``CPU_ATTN``.
"""

from __future__ import annotations

from .config import ServeConfig

BACKEND = "h2o_kv.vllm.attention.H2OAttentionBackend"


def register() -> None:
    if ServeConfig.from_env() is None:  # raises ValueError naming the variable when it is malformed
        return
    from . import patches

    patches.install()  # refuses an untested vLLM first
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
