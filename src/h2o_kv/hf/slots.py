"""One layer's storage in an :class:`~h2o_kv.hf.cache.H2OCache`: the slot buffer and transformers' cache-layer methods.

The buffer is ``[batch, kv_heads, slots, head_dim]`` keys and values (:class:`~h2o_kv.hf.quant.QuantizedSlots` with
``kv_bits``; :class:`~h2o_kv.hf.packed.PackedSlots`, each head's segment only, once a head-adaptive or across-layers
policy has given its heads unequal counts) with, per slot, the absolute column of its entry (``pos``), a validity
flag (``valid``) and the policy's running score (``scores``). Nothing here ranks or evicts: the per-step operations are
:class:`~h2o_kv.hf.cache.H2OLayer`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from ..policies import EntryView
from . import compat
from .packed import PackedSlots, padded
from .quant import QuantizedSlots

if TYPE_CHECKING:
    from .cache import H2OCache

NO_START = 2**60  # `start` of a sequence that has shown no real token yet


@dataclass
class Candidates:
    """A prompt chunk's candidates: the kept entries followed by the chunk's new ones."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    stored: tuple[QuantizedSlots, QuantizedSlots] | None = None  # kv_bits: the candidates' keys/values as stored


class Slots(compat.LayerNames, CacheLayerMixin):
    """One layer's storage: the slot buffer, its size, and transformers' cache-layer methods (no eviction)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: H2OCache):
        super().__init__()
        self.cache = cache
        self.seen = 0  # columns seen (one past the newest); positions keep counting, eviction never renumbers
        self._peak, self._peak_pending = 0, None  # the peak, and a device-side maximum not read back yet
        # decode fast path: `_free` is the one free slot of every (sequence, head) when the last eviction left
        # exactly that; `full` means every slot holds an entry (then attention needs no mask)
        self._free: torch.Tensor | None = None
        self.full = False
        self.head_capacity: torch.Tensor | None = None  # [batch, heads] after a head-adaptive selection

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((batch, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, 0, value_states.shape[-1]))
        self.pos = torch.zeros((batch, heads, 0), dtype=torch.long, device=self.device)
        self.valid = torch.zeros((batch, heads, 0), dtype=torch.bool, device=self.device)
        self.scores = torch.zeros((batch, heads, 0), dtype=torch.float32, device=self.device)
        if self.cache.kv_bits is not None:  # codes + scales + zeros, and the full-precision ring (hf/quant.py)
            quant = (self.cache.kv_bits, self.cache.kv_group_size, self.cache.kv_residual)
            self.keys, self.values = QuantizedSlots.empty(self.keys, *quant), QuantizedSlots.empty(self.values, *quant)
        self.start = torch.full((batch,), NO_START, dtype=torch.long, device=self.device)
        self._all_started = False
        self._free, self.full = None, False
        self.is_initialized = True

    @property
    def slots(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    @property
    def max_slots(self) -> float:
        """The most slots this layer may ever allocate: ``capacity + 1`` for a policy that evicts every step."""
        policy = self.cache.policy
        return policy.capacity + 1 if policy.evicts_during_decode else math.inf

    def capacity(self) -> torch.Tensor | float:
        """Entries each (sequence, KV head) may keep: the policy's capacity, or the head-adaptive counts."""
        return self.cache.policy.capacity if self.head_capacity is None else self.head_capacity

    def entry_count(self) -> torch.Tensor:
        """Valid entries per (sequence, KV head)."""
        return self.valid.sum(-1)

    @property
    def peak_entries(self) -> int:
        """The most entries any (sequence, KV head) held so far (read back from the device only when asked)."""
        if self._peak_pending is not None:
            self._peak, self._peak_pending = max(self._peak, int(self._peak_pending)), None
        return self._peak

    def note_peak(self, entries: int | torch.Tensor | None = None) -> None:
        """Fold ``entries`` (default: the current largest entry count, a device scalar) into the peak without a
        host synchronisation."""
        if entries is None:
            entries = self.entry_count().max()
        if isinstance(entries, int):
            self._peak = max(self._peak, entries)
        else:
            pending = self._peak_pending
            self._peak_pending = entries if pending is None else torch.maximum(pending, entries)

    def view(self, pos=None, valid=None, scores=None, keys=None) -> EntryView:
        """The policy's view of the slots (or of the given candidates)."""
        policy = self.cache.policy
        return EntryView(
            pos=self.pos if pos is None else pos,
            valid=self.valid if valid is None else valid,
            scores=self.scores if scores is None else scores,
            seen=self.seen,
            start=self.start,
            keys=(self.full_keys() if keys is None else keys) if policy.needs_keys else None,
        )

    def full_keys(self) -> torch.Tensor:
        """The slots' keys in full precision (dequantized with ``kv_bits``)."""
        return self.keys.read(self.pos, self.seen) if isinstance(self.keys, QuantizedSlots) else padded(self.keys)

    def _resize(self, slots: int) -> None:
        """Reallocate the buffer to ``slots`` slots, keeping the first ``min(old, new)`` entries."""
        keep = min(slots, self.slots)

        def resized(t: torch.Tensor, fill) -> torch.Tensor:
            if isinstance(t, (QuantizedSlots, PackedSlots)):
                return t.resized(slots)
            out = t.new_full((*t.shape[:2], slots, *t.shape[3:]), fill)
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self.keys, self.values = resized(self.keys, 0), resized(self.values, 0)
        self.pos, self.valid = resized(self.pos, -1), resized(self.valid, False)
        self.scores = resized(self.scores, 0.0)
        self._free, self.full = None, False

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more entries before they are appended one by one (a stepwise chunk)."""
        if self.is_initialized:
            need = int(self.entry_count().max()) + tokens
            if self.slots < min(need, self.max_slots):
                self._resize(int(min(need, self.max_slots)))

    def grow_segments(self) -> None:
        """Packed: one more slot for each head whose segment is full (a policy that grows after the prompt, or a
        prompt shorter than its budget); a head at its count keeps the free slot it has."""
        sizes = torch.maximum(self.keys.sizes, self.entry_count() + 1)
        grows, width = torch.stack([(sizes > self.keys.sizes).any().long(), sizes.max()]).tolist()  # one sync
        if grows:
            if width > self.slots:
                self._resize(width)
            self.keys, self.values = self.keys.grown(sizes, width), self.values.grown(sizes, width)

    def store(self, chunk: Candidates, index, held, keep: int, *, full_budget: bool) -> None:
        """Gather the candidates ``index`` (``None``: the first ``keep``) into the slots; ``held``: the head-adaptive
        counts per head (see :meth:`Policy.select`); ``full_budget``: the selection filled the budget."""
        policy = self.cache.policy
        width = keep if held is None else index.shape[2]  # head-adaptive: padded to the largest head's count
        self.head_capacity = held if held is not None and full_budget else None
        # a full budget will need its one free slot at the next token; a shorter prompt grows one slot at a time
        slots = width + 1 if full_budget and policy.evicts_during_decode else width
        new = chunk.keys.shape[2] - self.slots  # the chunk's own entries, last among the candidates
        self.keys, self.values = padded(self.keys), padded(self.values)  # gathered padded, packed again below
        if self.slots != slots:
            self._resize(slots)
        self._free, self.full = None, False
        self.valid.fill_(False)
        for name in ("keys", "values", "pos", "valid", "scores"):
            source = getattr(chunk, name)
            if chunk.stored is not None and name in ("keys", "values"):  # codes kept as stored, never re-quantized
                stored = chunk.stored[name == "values"]
                getattr(self, name).assign(stored if index is None else stored.gathered(index), width)
                getattr(self, name).remember(source[:, :, -new:], self.seen - new)
                continue
            if index is not None:
                gather_index = index if source.dim() == 3 else index.unsqueeze(-1).expand(-1, -1, -1, source.shape[-1])
                source = source.gather(2, gather_index)
            getattr(self, name)[:, :, :width] = source[:, :, :width]
        if held is not None:
            self.valid[:, :, :width] &= torch.arange(width, device=self.device) < held.unsqueeze(-1)
            if self.cache.packed and not isinstance(self.keys, QuantizedSlots):  # each head's count + its free slot
                sizes = held + (slots - width)
                self.keys, self.values = PackedSlots.pack(self.keys, sizes), PackedSlots.pack(self.values, sizes)
        self.note_peak()

    # -- transformers' cache-layer contract (besides update) ----------------------------------------------------
    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return self.seen + compat.query_length(query), 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "valid", "scores", "start"):
                setattr(self, name, getattr(self, name).index_select(0, indices.to(self.device)))
            if self.head_capacity is not None:
                self.head_capacity = self.head_capacity.index_select(0, indices.to(self.device))
            self._free, self.full = None, False

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "valid", "scores", "start"):
                setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
            if self.head_capacity is not None:
                self.head_capacity = self.head_capacity.repeat_interleave(repeats, dim=0)
            self._free, self.full = None, False

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("H2OCache cannot be cropped: evicted entries are gone for good.")
