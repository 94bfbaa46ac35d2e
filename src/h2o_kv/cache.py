"""A bounded KV cache for Hugging Face ``transformers`` with real eviction.

Each layer stores keys and values in a fixed slot buffer ``[batch, kv_heads, slots, head_dim]`` together
with the absolute column of each entry (``pos``), a validity flag and the policy's running score. Keys stay
rotated at their absolute positions, so slots may be in any order: attention is permutation invariant once
the mask is built from ``pos`` and ``valid``.

The data path of one forward chunk of ``c`` tokens through one layer:

1. :meth:`H2OLayer.update` (called by the model's attention module) either writes the single new token of
   a decode step into a free slot, in place, or - for a prompt chunk - returns the kept entries followed by
   the chunk as temporary candidates.
2. The ``"h2o"`` attention function (:mod:`h2o_kv.scoring`) attends over them and reports each entry's
   probability mass back through :meth:`H2OLayer.commit`.
3. ``commit`` folds the mass into the scores (the policy decides how) and evicts: after a decode step the
   single lowest-ranked slot is freed (so ``heavy + recent + 1`` slots suffice); after a prompt chunk the
   best ``heavy + recent`` candidates are gathered into the slot buffer.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .policies import EntryView, Policy, make_policy

_HANDOFF = threading.local()
NO_START = 2**60  # `start` of a sequence that has shown no real token yet


def pop_active_layer() -> H2OLayer | None:
    """The layer whose ``update`` ran last in this thread and still waits for its attention (or None)."""
    layer = getattr(_HANDOFF, "layer", None)
    _HANDOFF.layer = None
    return layer


def pop_mask_request() -> bool:
    """True when the mask being built is for an :class:`H2OCache` (set by its ``get_mask_sizes``)."""
    requested = getattr(_HANDOFF, "mask", False)
    _HANDOFF.mask = False
    return requested


@dataclass
class _Steps:
    """Tokens to be written and attended one at a time (a decode step, or a stepwise chunk)."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class _Chunk:
    """Candidates of a prompt chunk: the kept entries followed by the chunk's new entries."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor


class H2OLayer(CacheLayerMixin):
    """One layer's slot buffer. The policy ranks entries; this class only moves them."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: H2OCache):
        super().__init__()
        self.cache = cache
        self.seen = 0
        self.peak_entries = 0
        self._pending: _Steps | _Chunk | None = None
        self._stale: torch.Tensor | None = None
        self._forget_slot_state()

    @property
    def valid(self) -> torch.Tensor:
        """Which slots hold an entry, ``[batch, heads, slots]`` bool.

        In the steady state the victim of a decode step is refilled by the next step's write, so the fast path
        leaves its flag set (``_stale``, two scatters saved per layer and step); any other reader gets it cleared.
        """
        if self._stale is not None:
            self._valid.scatter_(2, self._stale, False)
            self._stale = None
        return self._valid

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:
        self._valid, self._stale = value, None

    def _forget_slot_state(self) -> None:
        """Drop what the decode fast path knows about the slots (after anything but a decode step moved them)."""
        # `_free`: the only free slot of every (sequence, head), [batch, heads, 1], when the last eviction left
        # exactly one; `full`: every slot holds a valid entry. Both let a decode step skip searches and counts.
        self._free: torch.Tensor | None = None
        self.full = False

    # -- storage -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((batch, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, 0, value_states.shape[-1]))
        self.pos = torch.zeros((batch, heads, 0), dtype=torch.long, device=self.device)
        self.valid = torch.zeros((batch, heads, 0), dtype=torch.bool, device=self.device)
        self.scores = torch.zeros((batch, heads, 0), dtype=torch.float32, device=self.device)
        self.start = torch.full((batch,), NO_START, dtype=torch.long, device=self.device)
        self._all_started = False
        self._forget_slot_state()
        self.is_initialized = True

    @property
    def slots(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    @property
    def max_slots(self) -> float:
        """The most slots this layer may ever allocate: ``heavy + recent + 1`` for bounded policies."""
        policy = self.cache.policy
        return policy.capacity + 1 if policy.evicts_during_decode else math.inf

    def _resize(self, slots: int) -> None:
        """Reallocate the buffer to ``slots`` slots, keeping the first ``min(old, new)`` entries."""
        keep = min(slots, self.slots)

        def resized(t: torch.Tensor, fill) -> torch.Tensor:
            out = t.new_full((*t.shape[:2], slots, *t.shape[3:]), fill)
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self.keys, self.values = resized(self.keys, 0), resized(self.values, 0)
        self.pos, self.valid = resized(self.pos, -1), resized(self.valid, False)
        self.scores = resized(self.scores, 0.0)
        self._forget_slot_state()

    def entry_count(self) -> torch.Tensor:
        """Valid entries per (sequence, KV head)."""
        return self.valid.sum(-1)

    # -- the cache-layer contract ----------------------------------------------------------------------
    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Stage a chunk for the attention function; returns the tensors it will attend over.

        A decode step (or any chunk when the cache is ``stepwise``) is staged as steps: the attention function
        writes each token into a free slot itself (:meth:`write_step`) and the layer's own buffers are
        returned. A prompt chunk returns the kept entries followed by the chunk (temporary candidates).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        stale = pop_active_layer()
        if stale is not None and stale.cache is not self.cache:
            stale._pending = None  # left by another cache's forward that raised: not ours to report
        elif self._pending is not None or stale is not None:
            for layer in self.cache.layers:
                layer._pending = None
            raise RuntimeError(
                "H2OCache was updated twice without its attention function running: the model's attention "
                "implementation must be 'h2o'. Call h2o_kv.enable_h2o(model) (h2o_kv.load_model does it)."
            )
        chunk = key_states.shape[2]
        if chunk == 1 or self.cache.stepwise:
            self._pending = _Steps(key_states, value_states)
            _HANDOFF.layer = self
            return self.keys, self.values
        batch, heads = key_states.shape[:2]
        columns = torch.arange(self.seen, self.seen + chunk, device=self.device)
        self._pending = _Chunk(
            keys=torch.cat([self.keys, key_states], dim=2),
            values=torch.cat([self.values, value_states], dim=2),
            pos=torch.cat([self.pos, columns.expand(batch, heads, chunk)], dim=2),
            valid=torch.cat([self.valid, self.valid.new_ones((batch, heads, chunk))], dim=2),
            scores=torch.cat([self.scores, self.scores.new_zeros((batch, heads, chunk))], dim=2),
        )
        self.seen += chunk
        _HANDOFF.layer = self
        return self._pending.keys, self._pending.values

    def write_step(self, key: torch.Tensor, value: torch.Tensor, is_real: torch.Tensor | None) -> None:
        """Write one token (``[batch, heads, 1, dim]``) into a free slot of every (sequence, head), in place."""
        free = self._free  # known when the last eviction left exactly one free slot everywhere (steady state)
        if free is None:
            # (a buffer already at max_slots cannot grow: skip the count, a sync, on the bounded hot path)
            if self.slots < self.max_slots and int(self.entry_count().max()) >= self.slots:
                self._resize(int(min(self.max_slots, self.slots + max(16, self.slots // 4))))
            free = self.valid.byte().argmin(-1, keepdim=True)  # [batch, heads, 1]: the first free slot
        ops = kernels.cpu_ops(self.keys, self.values, self.pos, self.scores, free)
        if ops is not None:  # one fused pass for the four writes below
            ops.write_slot(
                self.keys, self.values, self.pos, self.scores, free, key.contiguous(), value.contiguous(), self.seen
            )
        else:
            for buffer, new in ((self.keys, key), (self.values, value)):
                buffer.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, new.shape[-1]), new)
            self.pos.scatter_(2, free, self.seen)
            self.scores.scatter_(2, free, 0.0)
        all_real = is_real is None or (self._free is not None and bool(is_real.all()))  # (only needed then)
        if all_real and self._stale is not None:  # the free slot is the stale victim: its flag is already True
            self._stale = None
        else:
            real = True if is_real is None else is_real[:, None, None].expand(-1, self.valid.shape[1], 1)
            self.valid.scatter_(2, free, real)
        if not self._all_started:
            self._note_start(self.valid.new_ones(self.valid.shape[0])[:, None] if is_real is None else is_real[:, None])
        # the only free slot got a real token everywhere: no slot is free now
        self.full = self._free is not None and all_real
        self._free = None
        self.seen += 1

    def get_mask_sizes(self, cache_position) -> tuple[int, int]:
        query_length = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "valid", "scores", "start"):
                setattr(self, name, getattr(self, name).index_select(0, indices.to(self.device)))
            self._forget_slot_state()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "valid", "scores", "start"):
                setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
            self._forget_slot_state()

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("H2OCache cannot be cropped: evicted entries are gone for good.")

    # -- called by the attention function -------------------------------------------------------------
    @property
    def pending(self) -> _Steps | _Chunk:
        return self._pending

    def mark_padding(self, is_real: torch.Tensor) -> None:
        """Flag a prompt chunk's pad tokens (``is_real``: ``[batch, chunk]`` bool) as never attended."""
        chunk = is_real.shape[1]
        self._pending.valid[:, :, -chunk:] &= is_real[:, None, :]
        self.seen -= chunk
        self._note_start(is_real)
        self.seen += chunk

    def _note_start(self, is_real: torch.Tensor) -> None:
        """Remember the column of each sequence's first real token (``is_real``: ``[batch, chunk]``)."""
        first = self.seen + is_real.byte().argmax(-1)
        self.start = torch.where((self.start == NO_START) & is_real.any(-1), first, self.start)
        self._all_started = bool((self.start != NO_START).all())  # then write_step can skip this

    def commit(self, mass: torch.Tensor | None, last: torch.Tensor | None) -> None:
        """Fold the attention of the chunk (or of the step just written) into the scores, then evict."""
        policy = self.cache.policy
        if isinstance(self._pending, _Chunk):
            chunk, self._pending = self._pending, None
            chunk.scores = policy.accumulate(chunk.scores, mass, last)
            self._keep_best(chunk, policy)
        elif self.full and policy.evicts_during_decode and self.slots > policy.capacity:
            self.peak_entries = self.slots  # every slot holds an entry
            self._evict_one(policy, mass, last)  # steady state: the policy folds in the mass as it picks the victim
        else:
            self.scores = policy.accumulate(self.scores, mass, last)
            if self.peak_entries < self.slots:  # entries never exceed the slots: skip the count once reached
                self.peak_entries = max(self.peak_entries, int(self.entry_count().max()))
            if policy.evicts_during_decode:
                self._evict_one(policy)

    def finish_steps(self) -> None:
        self._pending = None

    def _view(self, pos, valid, scores) -> EntryView:
        return EntryView(pos=pos, valid=valid, scores=scores, seen=self.seen, start=self.start)

    def _evict_one(self, policy: Policy, mass: torch.Tensor | None = None, last: torch.Tensor | None = None) -> None:
        """Free the lowest-ranked slot of every (sequence, head) that holds more than the budget.

        In the steady state (all slots valid, every (sequence, head) over the budget) this step's ``mass`` and
        ``last`` are passed here and folded into the scores by :meth:`Policy.decode_victim`, which may fuse it all.
        """
        if self.full and self.slots > policy.capacity:  # steady state: no masking, no counts
            self.scores, victim = policy.decode_victim(self._view(self.pos, self._valid, self.scores), mass, last)
            self._stale = victim  # freed lazily: the next write refills it (see `valid`)
            self._free, self.full = victim, False  # the victim is now the only free slot
            return
        over = self.entry_count() > policy.capacity
        n_over = int(over.sum())
        if n_over == 0:
            return
        rank = policy.keep_score(self._view(self.pos, self.valid, self.scores))
        victim = torch.where(self.valid, rank, math.inf).min(-1, keepdim=True).indices  # the first lowest, as argmin
        still_valid = self.valid.gather(2, victim) & ~over.unsqueeze(-1)
        self.valid.scatter_(2, victim, still_valid)
        if n_over == over.numel() and self.slots == policy.capacity + 1:
            self._free = victim  # every slot was valid (entries > capacity = slots - 1): the victim is the free one

    def _keep_best(self, chunk: _Chunk, policy: Policy) -> None:
        """Gather the best ``capacity`` candidates of a prompt chunk into the slot buffer."""
        counts = chunk.valid.sum(-1)
        keep = int(min(policy.capacity, counts.max()))
        if keep < chunk.valid.shape[2] or not bool(chunk.valid.all()):
            rank = policy.keep_score(self._view(chunk.pos, chunk.valid, chunk.scores))
            index = rank.masked_fill(~chunk.valid, -math.inf).topk(keep, dim=-1).indices
        else:
            index = None
        slots = int(min(self.max_slots, keep + 1))
        if self.slots != slots:
            self._resize(slots)
        self._forget_slot_state()
        self.valid.fill_(False)
        for name in ("keys", "values", "pos", "valid", "scores"):
            source = getattr(chunk, name)
            if index is not None:
                gather_index = index if source.dim() == 3 else index.unsqueeze(-1).expand(-1, -1, -1, source.shape[-1])
                source = source.gather(2, gather_index)
            getattr(self, name)[:, :, :keep] = source
        self.peak_entries = max(self.peak_entries, int(self.entry_count().max()))


class H2OCache(Cache):
    """A bounded KV cache: ``heavy`` heavy hitters plus ``recent`` newest tokens per layer and KV head.

    Args:
        heavy, recent: absolute entry counts (``heavy + recent`` entries are kept after every step).
        budget: instead of counts, a ratio in (0, 1] of the prompt length ``L`` (the longest prompt of a batch,
            i.e. the padded length): ``heavy = recent = floor(budget * L / 2)``, fixed for the whole generation
            (the H2O paper's "20% budget" is ``budget=0.2``).
        policy: a registered policy name (``h2o``, ``local``, ``sink``, ``full``, ...) or a :class:`Policy`.
        prefill_chunk_mb: bound on the attention scores held at once while a prompt is processed; the prompt is
            walked in query chunks so no ``L x L`` matrix exists.
        stepwise: process every token of a multi-token chunk as its own decode step (attend, score, evict),
            exactly as feeding the tokens one at a time would, but in one batched forward pass (projections and
            MLPs run over the whole chunk; only the cheap slot bookkeeping is sequential). This is the paper's
            streaming protocol and the fast exact path for teacher-forced evaluation. Can be switched between
            calls, e.g. one-shot prompt compression followed by stepwise scoring of a continuation.
        streaming: position rolling (H2O paper's streaming variant, StreamingLLM arXiv:2309.17453): keys are
            stored before RoPE and re-rotated at their rank inside the cache at every step, so the model never
            sees a position beyond ``heavy + recent`` however long the stream (see :mod:`h2o_kv.rotary`).
            Needs a RoPE model and a bounded policy; feed long texts with ``stepwise=True``.

    The model's attention implementation must be ``"h2o"``: ``h2o_kv.load_model`` sets it, and
    ``h2o_kv.enable_h2o(model)`` does it for a model loaded with plain ``transformers``.
    """

    def __init__(
        self,
        heavy: int | None = None,
        recent: int | None = None,
        *,
        budget: float | None = None,
        policy: str | Policy = "h2o",
        prefill_chunk_mb: float = 64.0,
        stepwise: bool = False,
        streaming: bool = False,
        **policy_options,
    ):
        super().__init__(layers=[])
        self.stepwise = stepwise
        self.streaming = bool(streaming)  # streaming mode (h2o_kv.rotary)
        if streaming and (policy == "full" or getattr(policy, "name", None) == "full"):
            raise ValueError("streaming=True needs a bounded policy (h2o, sink, local, ...), not 'full'")
        if not prefill_chunk_mb > 0:
            raise ValueError(f"prefill_chunk_mb must be > 0, got {prefill_chunk_mb}")
        self.prefill_chunk_bytes = int(prefill_chunk_mb * 2**20)
        self.budget = budget
        if isinstance(policy, Policy):
            if heavy is not None or recent is not None or budget is not None or policy_options:
                raise ValueError("pass the budget inside the Policy object or as heavy/recent/budget, not both")
            self.policy_name, self._policy_options, self.policy = policy.name, {}, policy
            return
        self.policy_name, self._policy_options = policy, policy_options
        make_policy(policy, 0, 0, **policy_options)  # validates the name and options early
        if budget is not None:
            if heavy is not None or recent is not None:
                raise ValueError("give either budget (a ratio) or heavy/recent (token counts), not both")
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
                raise ValueError(f"budget must be a ratio in (0, 1] of the prompt length, got {budget!r}")
            self.policy = None  # resolved from the prompt length at the first update
            return
        if heavy is None and recent is None and policy == "full":
            heavy = recent = 0
        for label, value in (("heavy", heavy), ("recent", recent)):
            if value is None:
                raise ValueError(f"{label} is required: give heavy and recent (token counts) or budget (a ratio)")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{label} must be an integer >= 0, got {value!r}")
        if heavy + recent == 0 and policy != "full":
            raise ValueError("heavy + recent must be >= 1: a cache that keeps nothing cannot generate")
        self.policy = make_policy(policy, heavy, recent, **policy_options)

    # -- policy resolution ----------------------------------------------------------------------------
    def _resolve(self, prompt_length: int) -> None:
        if self.policy is None:
            half = math.floor(self.budget * prompt_length / 2)
            if half == 0:
                raise ValueError(
                    f"budget={self.budget} of a {prompt_length}-token prompt keeps no entry "
                    "(heavy = recent = floor(budget * L / 2) = 0); use a larger budget or heavy/recent"
                )
            self.policy = make_policy(self.policy_name, half, half, **self._policy_options)
        capacity = self.policy.capacity
        if self.policy.name != "full" and capacity >= prompt_length:
            warnings.warn(
                f"H2OCache budget heavy + recent = {capacity} >= prompt length {prompt_length}: nothing is "
                f"evicted while a sequence holds at most {capacity} tokens (it then behaves like the full cache)",
                stacklevel=4,
            )

    # -- Cache contract -------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict[str, Any] | None = None):
        while len(self.layers) <= layer_idx:
            self.layers.append(H2OLayer(self))
        if layer_idx == 0 and self.layers[0].seen == 0:
            self._resolve(key_states.shape[2])
        if self.streaming:  # streaming mode: store keys before RoPE (h2o_kv.rotary)
            key_states = self._unrotate_keys(key_states, layer_idx, cache_kwargs)
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    def _unrotate_keys(self, key_states, layer_idx: int, cache_kwargs: dict[str, Any] | None):
        """Streaming mode: undo the RoPE the attention module applied; keep cos/sin for the query."""
        from .rotary import _NO_ROPE_MESSAGE, raw_keys

        if not cache_kwargs or cache_kwargs.get("cos") is None or cache_kwargs.get("sin") is None:
            raise ValueError(_NO_ROPE_MESSAGE.format(what="passes no rotary cos/sin to the cache"))
        cos, sin = cache_kwargs["cos"], cache_kwargs["sin"]
        self.layers[layer_idx].rope = (cos, sin)
        return raw_keys(key_states, cos, sin)

    def get_mask_sizes(self, cache_position, layer_idx: int) -> tuple[int, int]:
        _HANDOFF.mask = True
        seen = self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0
        query_length = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
        return seen + query_length, 0

    def reset(self) -> None:
        self.layers = []
        if self.budget is not None:
            self.policy = None

    @property
    def heavy(self) -> int | None:
        return None if self.policy is None else self.policy.heavy

    @property
    def recent(self) -> int | None:
        return None if self.policy is None else self.policy.recent

    def stats(self) -> dict[str, Any]:
        """Entries held vs seen and KV bytes vs a full cache, for the last forward pass."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        seen = layers[0].seen if layers else 0
        held = max((int(layer.entry_count().max()) for layer in layers), default=0)

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        kv_bytes = sum(nbytes(layer.keys) + nbytes(layer.values) for layer in layers)
        full_bytes = sum(
            nbytes(layer.keys[:, :, :1]) * seen + nbytes(layer.values[:, :, :1]) * seen for layer in layers
        )
        return {
            "policy": self.policy.describe() if self.policy else self.policy_name,
            "heavy": self.heavy,
            "recent": self.recent,
            "layers": len(layers),
            "batch_size": layers[0].keys.shape[0] if layers else 0,
            "seen_tokens": seen,
            "kv_tokens": held,
            "peak_kv_tokens": max((layer.peak_entries for layer in layers), default=0),
            "evicted_tokens": seen - held,
            "slots": max((layer.slots for layer in layers), default=0),
            "kv_bytes": kv_bytes,
            "full_kv_bytes": full_bytes,
            "kv_ratio": kv_bytes / full_bytes if full_bytes else 1.0,
        }
