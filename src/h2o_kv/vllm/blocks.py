"""The scheduler side of H2O in vLLM: how many KV blocks a bounded request holds, through vLLM's own plugin registry.

vLLM 0.32 lets a plugin register a KV-cache spec with its block manager (``vllm.v1.kv_cache_spec_registry``), and
the model runner passes every layer's spec through its attention backend's ``customize_spec``. So the H2O backend
(:mod:`h2o_kv.vllm.attention`) turns vLLM's ``FullAttentionSpec`` into :class:`H2OAttentionSpec` (the same layout
and grouping, a spec of its own kind), whose manager, :class:`H2OAttentionManager`, allocates by reservation:

* every request takes its peak block count at admission (:meth:`Reservation.tokens`), so the scheduler's admission
  check counts the bounded size and no request needs a block later - no request is ever preempted (vLLM's recompute
  would re-prefill prompt plus generated tokens as one prompt, not the step-by-step eviction that produced them);
* once a bounded request's prompt is computed (and compressed by the worker in that step), the blocks past its
  steady size return to the pool.

A manager sees request ids only, not sampling parameters, so each request's :class:`Reservation` is noted where the
request is (``KVCacheManager.allocate_slots``, a patch in :mod:`h2o_kv.vllm.patches`) and looked up here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ..budget import Budget
from .config import ServeConfig, request_config

_RESERVATIONS: dict[str, Reservation] = {}  # request id -> its block reservation (engine core process)
logger = logging.getLogger("vllm.h2o_kv")  # under vLLM's logger: its handler and format


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


def note(request, max_model_len: int) -> None:
    """Record ``request``'s reservation once (at its first allocation)."""
    if request.request_id not in _RESERVATIONS:
        reservation = Reservation.of(request, max_model_len)
        if reservation is not None:
            _RESERVATIONS[request.request_id] = reservation


def drop(request_id: str) -> None:
    _RESERVATIONS.pop(request_id, None)


def reservations() -> dict[str, Reservation]:
    """The live reservations (engine core), for tests and metrics."""
    return dict(_RESERVATIONS)


@dataclass(frozen=True, kw_only=True)
class H2OAttentionSpec(FullAttentionSpec):
    """A full-attention layer of the H2O backend: vLLM's layout, blocks managed by :class:`H2OAttentionManager`."""

    @classmethod
    def of(cls, spec: FullAttentionSpec) -> H2OAttentionSpec:
        return cls(**{field.name: getattr(spec, field.name) for field in fields(spec) if field.init})


class H2OAttentionManager(FullAttentionManager):
    """vLLM's full-attention manager, asked for each request's reservation instead of the tokens it has so far."""

    @staticmethod
    def _reserved(request_id: str, num_tokens: int) -> int:
        reservation = _RESERVATIONS.get(request_id)
        return num_tokens if reservation is None else reservation.tokens(num_tokens)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return super().get_num_blocks_to_allocate(request_id, self._reserved(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
        return super().allocate_new_blocks(request_id, self._reserved(request_id, num_tokens), *args, **kwargs)

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, *args, **kwargs):
        reservation = _RESERVATIONS.get(request_id)
        blocks = self.req_to_blocks.get(request_id)
        if reservation is not None and blocks and processed_computed_tokens >= reservation.prompt:
            keep = -(-reservation.steady // self.block_size)
            if len(blocks) > keep:  # the prompt was compressed into the first `keep` blocks in the last step
                tail = blocks[keep:]
                del blocks[keep:]
                self.block_pool.free_blocks(reversed(tail))
        return super().remove_skipped_blocks(request_id, processed_computed_tokens, *args, **kwargs)


def register() -> None:
    """Register :class:`H2OAttentionSpec` with its manager, grouped with full attention (every process)."""
    KVCacheSpecRegistry._ensure_registered()  # vLLM's own specs first: it registers them only into an empty registry
    KVCacheSpecRegistry.register(H2OAttentionSpec, H2OAttentionManager, uniform_type_base_spec=FullAttentionSpec)
