"""A bounded KV cache for Hugging Face ``transformers`` with real eviction (the transformers backend).

Each layer stores keys and values in a slot buffer ``[batch, kv_heads, slots, head_dim]`` with, per slot, the
absolute column of its entry (``pos``), a validity flag (``valid``) and the policy's running score (``scores``). Keys
stay rotated at their absolute positions, so slots may be in any order: attention is permutation invariant once the
mask is built from ``pos`` and ``valid``.

The per-step contract (the whole interface between this module, :mod:`h2o_kv.hf.scoring` and the policies):

1. transformers calls :meth:`H2OCache.update` with a chunk's new keys and values. The layer only *stages* them as a
   :class:`Step` for the attention function and returns them unchanged (:func:`claim_step` hands the step over: the
   model calls its attention function right after ``update``, in the same thread, with the returned tensors).
2. The ``"h2o"`` attention function claims the step and, for a **prompt chunk**, asks the layer for the
   :meth:`~H2OLayer.candidates` (kept entries followed by the chunk), attends over them computing each entry's
   probability mass, and hands the mass to :meth:`~H2OLayer.keep`: the policy folds it into the scores and the best
   ``capacity`` candidates are gathered into the slots. For a **decode step** (or every token of a ``stepwise``
   chunk) it calls :meth:`~H2OLayer.append` (the token goes into a free slot, in place), attends over the slots, and
   hands the mass to :meth:`~H2OLayer.evict` (the policy frees the lowest-ranked slot if more than ``capacity``
   entries are kept, so ``capacity + 1`` slots suffice).
3. The policy (:mod:`h2o_kv.policies`) only ranks entries through an :class:`~h2o_kv.policies.EntryView`; this
   module only moves them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import kernels
from ..budget import Budget
from ..policies import EntryView, Policy, make_policy
from . import compat, quant
from .quant import QuantizedSlots

STATISTICS = ("sum", "max")  # of a scoring pass's attention (H2O's sum, KVzip's max)
NO_START = 2**60  # `start` of a sequence that has shown no real token yet
_STAGED = threading.local()


class H2OBudgetWarning(UserWarning):
    """The budget is at least the prompt: nothing is evicted until a sequence outgrows it."""


@dataclass
class Step:
    """One layer's new keys and values ``[batch, kv_heads, chunk, head_dim]``, staged for the attention function."""

    layer: H2OLayer
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def is_prompt(self) -> bool:
        """A multi-token chunk compressed at once (else: every token is a decode step)."""
        return self.keys.shape[2] > 1 and not self.layer.cache.stepwise


def claim_step(key: torch.Tensor) -> Step | None:
    """The step staged by the last :meth:`H2OCache.update` in this thread, if ``key`` is the tensor it returned.

    Returns None when no step is staged (the model runs with another cache). A staged step whose keys are not
    ``key`` means the model changed the keys between the cache and the attention function: refused, since
    attending without the cache's entries would be silently wrong.
    """
    step = getattr(_STAGED, "step", None)
    _STAGED.step = None
    if step is None:
        return None
    if step.keys is not key:
        raise RuntimeError(
            "the 'h2o' attention received other keys than H2OCache.update returned: this model transforms keys "
            "between its cache and its attention function, which h2o-kv does not support"
        )
    return step


@dataclass
class Candidates:
    """A prompt chunk's candidates: the kept entries followed by the chunk's new ones."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    stored: tuple[QuantizedSlots, QuantizedSlots] | None = None  # kv_bits: the candidates' keys/values as stored


class H2OLayer(compat.LayerNames, CacheLayerMixin):
    """One layer's slot buffer. The policy ranks entries; this class only moves them."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: H2OCache):
        super().__init__()
        self.cache = cache
        self.seen = 0  # columns seen (one past the newest); positions keep counting, eviction never renumbers
        self.peak_entries = 0
        # decode fast path: `_free` is the one free slot of every (sequence, head) when the last eviction left
        # exactly that; `full` means every slot holds an entry (then attention needs no mask)
        self._free: torch.Tensor | None = None
        self.full = False
        self.head_capacity: torch.Tensor | None = None  # [batch, heads] after a head-adaptive selection

    # -- storage --------------------------------------------------------------------------------------------------
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
        return self.keys.read(self.pos, self.seen) if isinstance(self.keys, QuantizedSlots) else self.keys

    def _resize(self, slots: int) -> None:
        """Reallocate the buffer to ``slots`` slots, keeping the first ``min(old, new)`` entries."""
        keep = min(slots, self.slots)

        def resized(t: torch.Tensor, fill) -> torch.Tensor:
            if isinstance(t, QuantizedSlots):
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

    # -- transformers' cache-layer contract ---------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """Stage the chunk for the attention function (see the module docstring); returns it unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        staged = getattr(_STAGED, "step", None)
        if staged is not None and staged.layer.cache is self.cache:
            _STAGED.step = None
            raise RuntimeError(
                "H2OCache was updated twice without its attention function running: the model's attention "
                "implementation must be 'h2o'. Call h2o_kv.enable_h2o(model) (h2o_kv.load_model does it)."
            )
        _STAGED.step = Step(self, key_states, value_states)
        return key_states, value_states

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

    # -- a prompt chunk -------------------------------------------------------------------------------------------
    def candidates(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor | None) -> Candidates:
        """The kept entries followed by a chunk of ``c`` new ones (``is_real``: ``[batch, c]``, False for padding)."""
        batch, heads, chunk = keys.shape[:3]
        columns = torch.arange(self.seen, self.seen + chunk, device=self.device)
        new_valid = self.valid.new_ones((batch, heads, chunk))
        if is_real is not None:
            new_valid &= is_real[:, None, :]
        self._note_start(is_real if is_real is not None else new_valid[:, 0])
        stored = None
        if isinstance(self.keys, QuantizedSlots):  # kept entries read back; the chunk's own are exact in this pass
            stored = (self.keys.with_chunk(keys), self.values.with_chunk(values))
            keys = torch.cat([self.keys.read(self.pos, self.seen), keys], dim=2)
            values = torch.cat([self.values.read(self.pos, self.seen), values], dim=2)
        else:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.seen += chunk
        return Candidates(
            keys=keys,
            values=values,
            pos=torch.cat([self.pos, columns.expand(batch, heads, chunk)], dim=2),
            valid=torch.cat([self.valid, new_valid], dim=2),
            scores=torch.cat([self.scores, self.scores.new_zeros((batch, heads, chunk))], dim=2),
            stored=stored,
        )

    def keep(self, chunk: Candidates, mass: torch.Tensor | None, last: torch.Tensor | None) -> None:
        """Fold a prompt chunk's attention into the scores and gather the best ``capacity`` candidates."""
        policy = self.cache.policy
        chunk.scores = policy.accumulate(chunk.scores, mass, last)
        scoring = self.cache.scoring_rows  # a scoring pass's rows only scored: their entries and columns go
        if scoring:
            chunk.valid[:, :, -scoring:] = False
            self.seen -= scoring
        if policy.across_layers:  # every candidate stays until all layers have scored (H2OCache.select_across_layers)
            self.cache.selection_pending = True
            self.store(chunk, None, None, chunk.valid.shape[2] - scoring, full_budget=False)
            return
        counts = chunk.valid.sum(-1)
        keep = int(min(policy.capacity, counts.max()))
        index = held = None
        if keep < chunk.valid.shape[2] or not bool(chunk.valid.all()):
            rank = policy.keep_score(self.view(chunk.pos, chunk.valid, chunk.scores, chunk.keys))
            index, held = policy.select(rank.masked_fill(~chunk.valid, -math.inf), keep)
        self.store(chunk, index, held, keep, full_budget=keep == policy.capacity)

    def store(self, chunk: Candidates, index, held, keep: int, *, full_budget: bool) -> None:
        """Gather the candidates ``index`` (``None``: the first ``keep``) into the slots; ``held``: the head-adaptive
        counts per head (see :meth:`Policy.select`); ``full_budget``: the selection filled the budget."""
        policy = self.cache.policy
        width = keep if held is None else index.shape[2]  # head-adaptive: padded to the largest head's count
        self.head_capacity = held if held is not None and full_budget else None
        # a full budget will need its one free slot at the next token; a shorter prompt grows one slot at a time
        slots = width + 1 if full_budget and policy.evicts_during_decode else width
        new = chunk.keys.shape[2] - self.slots  # the chunk's own entries, last among the candidates
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
        self.peak_entries = max(self.peak_entries, int(self.entry_count().max()))

    def _note_start(self, is_real: torch.Tensor) -> None:
        """Remember the column of each sequence's first real token (``is_real``: ``[batch, chunk]``)."""
        first = self.seen + is_real.byte().argmax(-1)
        self.start = torch.where((self.start == NO_START) & is_real.any(-1), first, self.start)
        self._all_started = bool((self.start != NO_START).all())  # then `append` can skip this

    # -- a decode step --------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, is_real: torch.Tensor | None) -> None:
        """Write one token (``[batch, heads, 1, dim]``; ``is_real``: ``[batch]``) into a free slot, in place."""
        free = self._free  # known when the last eviction left exactly one free slot everywhere (steady state)
        if free is None:
            if self.slots < self.max_slots and int(self.entry_count().max()) >= self.slots:
                self._resize(self.slots + 1)  # grow as a plain cache does: never more slots than entries + 1
            free = self.valid.byte().argmin(-1, keepdim=True)  # [batch, heads, 1]: the first free slot
        real = None if is_real is None or bool(is_real.all()) else is_real
        quantized = isinstance(self.keys, QuantizedSlots)  # the fused write is for plain buffers
        ops = None if quantized else kernels.cpu_ops(self.keys, self.values, self.pos, self.scores, self.valid, free)
        if ops is not None:  # one fused pass for the five writes below
            ops.write_slot(self.keys, self.values, self.pos, self.scores, self.valid, free, key.contiguous(),
                           value.contiguous(), self.seen)  # fmt: skip
        else:
            for buffer, new in ((self.keys, key), (self.values, value)):
                if quantized:
                    buffer.write(free, new, self.seen)
                    continue
                buffer.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, new.shape[-1]), new)
            self.pos.scatter_(2, free, self.seen)
            self.scores.scatter_(2, free, 0.0)
            self.valid.scatter_(2, free, True)
        if real is not None:  # pad tokens of a padded batch take the slot but are never attended
            self.valid.scatter_(2, free, real[:, None, None].expand(-1, self.valid.shape[1], 1))
        if not self._all_started:
            self._note_start(self.valid.new_ones(self.valid.shape[0])[:, None] if is_real is None else is_real[:, None])
        self.full = self._free is not None and real is None  # the only free slot got a real token everywhere
        self._free = None
        self.seen += 1

    def evict(self, mass: torch.Tensor | None, last: torch.Tensor | None) -> None:
        """Fold a decode step's attention into the scores; free the lowest-ranked slot where over ``capacity``."""
        policy = self.cache.policy
        if not policy.evicts_during_decode:
            self.scores = policy.accumulate(self.scores, mass, last)
            self.peak_entries = max(self.peak_entries, self.slots if self.full else int(self.entry_count().max()))
            return
        capacity = self.capacity()
        if self.full and self.slots > policy.capacity:  # steady state: every slot valid, all over the budget
            self.peak_entries = max(self.peak_entries, self.slots)
            self.scores, victim = policy.decode_victim(self.view(), mass, last)
            self.valid.scatter_(2, victim, False)
            self._free, self.full = victim, False  # the victim is now the only free slot
            return
        self.scores = policy.accumulate(self.scores, mass, last)
        self.peak_entries = max(self.peak_entries, int(self.entry_count().max()))
        over = self.entry_count() > capacity
        n_over = int(over.sum())
        if n_over == 0:
            return
        rank = policy.keep_score(self.view())
        victim = torch.where(self.valid, rank, math.inf).min(-1, keepdim=True).indices  # the first lowest, as argmin
        self.valid.scatter_(2, victim, self.valid.gather(2, victim) & ~over.unsqueeze(-1))
        if n_over == over.numel() and bool(torch.all(torch.as_tensor(capacity) + 1 == self.slots)):
            self._free = victim  # every slot was valid (entries > capacity = slots - 1): the victim is the free one


class H2OCache(Cache):
    """A bounded KV cache: ``heavy`` heavy hitters plus ``recent`` newest tokens per layer and KV head.

    Args:
        heavy, recent: absolute entry counts (``heavy + recent`` entries are kept after every step).
        budget: instead of counts, a ratio in (0, 1] of the prompt length ``L`` (the padded length of a batch):
            ``heavy = recent = max(1, floor(budget * L / 2))``, fixed for the whole generation (the H2O paper's "20%
            budget" is ``budget=0.2``; :class:`h2o_kv.Budget` is the rule).
        policy: a registered policy name (``h2o``, ``local``, ``sink``, ``full``, ...) or a :class:`Policy` object
            (which carries its own heavy/recent). ``full`` evicts nothing and takes no budget.
        prefill_chunk_mb: bound on the attention scores held at once while a prompt is processed; the prompt is
            walked in query blocks so no ``L x L`` matrix exists.
        stepwise: process every token of a multi-token chunk as its own decode step (attend, score, evict), exactly
            as feeding the tokens one at a time would, but in one batched forward pass (projections and MLPs run
            over the whole chunk; only the slot bookkeeping is sequential). This is the paper's streaming protocol
            and the fast exact path for teacher-forced evaluation. May be switched between calls.
        streaming: position rolling (H2O paper's streaming variant, StreamingLLM arXiv:2309.17453): keys are stored
            before RoPE and re-rotated at their rank inside the cache at every step, so the model never sees a
            position beyond ``heavy + recent`` however long the stream (see :mod:`h2o_kv.hf.rotary`). Needs a RoPE
            model and a bounded policy; feed long texts with ``stepwise=True``.
        kv_bits: store the kept entries quantized, 8 bits or 4 bits (two per byte), with a scale and a zero point per
            ``kv_group_size`` numbers of each entry (64, as transformers' ``QuantizedCache``); the newest
            ``kv_residual`` columns (64) are also held in full precision and read from there. ``None`` (default):
            full precision. The format and which entries stay exact: :mod:`h2o_kv.hf.quant`.

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
        kv_bits: int | None = None,
        kv_group_size: int = quant.DEFAULT_GROUP,
        kv_residual: int = quant.DEFAULT_RESIDUAL,
        **policy_options,
    ):
        super().__init__(layers=[])
        self.kv_bits = quant.check_bits(kv_bits)
        self.kv_group_size = quant.check_group(kv_group_size)
        if not isinstance(kv_residual, int) or isinstance(kv_residual, bool) or kv_residual < 0:
            raise ValueError(f"kv_residual must be an integer >= 0; got {kv_residual!r}")
        self.kv_residual = kv_residual
        if not prefill_chunk_mb > 0:
            raise ValueError(f"prefill_chunk_mb must be > 0, got {prefill_chunk_mb}")
        self.prefill_chunk_bytes = int(prefill_chunk_mb * 2**20)
        self.stepwise = stepwise
        self.streaming = bool(streaming)
        self.budget: Budget | None = None
        if isinstance(policy, Policy):
            if heavy is not None or recent is not None or budget is not None or policy_options:
                raise ValueError("pass the budget inside the Policy object or as heavy/recent/budget, not both")
            self.policy_name, self._policy_options, self.policy = policy.name, {}, policy
        else:
            self.policy_name, self._policy_options = policy, policy_options
            probe = make_policy(policy, 0, 0, **policy_options)  # validates the name and options early
            if probe.bounded:
                self.budget = Budget.of(budget, heavy, recent)
                self.policy = None if self.budget.is_ratio else make_policy(policy, heavy, recent, **policy_options)
            elif heavy is not None or recent is not None or budget is not None:
                raise ValueError(f"policy {policy!r} keeps every entry: give no budget/heavy/recent")
            else:
                self.policy = probe
        if self.streaming and self.policy is not None and not self.policy.bounded:
            raise ValueError("streaming=True needs a bounded policy (h2o, sink, local, ...), not 'full'")
        if self.kv_bits is not None and (self.policy or probe).across_layers:
            raise ValueError(f"kv_bits is not supported with the across-layers policy {self.policy_name!r}")
        if self.streaming and (self.policy or probe).head_adaptive:
            raise ValueError(f"streaming=True does not support the head-adaptive policy {self.policy_name!r}")
        self.scoring_rows, self.scoring_statistic = 0, "sum"  # set by scoring_pass() for one forward
        self.selection_pending = False  # an across-layers policy's prompt awaits select_across_layers()

    def select_across_layers(self) -> None:
        """Keep the best entries of every layer and KV head together, once a prompt has been scored by all layers.

        For a policy with :attr:`~h2o_kv.Policy.across_layers` (:class:`~h2o_kv.policies.AcrossLayers`) a prompt
        chunk keeps all its candidates; this step then gives the model's whole budget (``layers * heads *
        capacity`` entries per sequence) to the best-ranked entries overall. It runs by itself when the next forward
        starts (and here when called after a prefill); it does nothing when no selection is pending.
        """
        if not self.selection_pending:
            return
        self.selection_pending = False
        layers = [layer for layer in self.layers if layer.is_initialized]
        policy = self.policy
        counts = max(int(layer.entry_count().max()) for layer in layers)
        keep = int(min(policy.capacity, counts))
        ranks = [policy.keep_score(layer.view()).masked_fill(~layer.valid, -math.inf) for layer in layers]
        for layer, (index, held) in zip(layers, policy.select_layers(ranks, keep), strict=True):
            # valid is cloned: store() clears the layer's flags before gathering when the slot count is unchanged
            chunk = Candidates(layer.keys, layer.values, layer.pos, layer.valid.clone(), layer.scores)
            layer.store(chunk, index, held, keep, full_budget=keep == policy.capacity)

    @contextlib.contextmanager
    def scoring_pass(self, rows: int, statistic: str = "sum"):
        """The one prompt forward run inside this block ends with ``rows`` rows that only *score*.

        Those rows attend as usual and their attention is the policy's observation window (``last``: the
        probability ``sum`` over the rows and the group's query heads, or its ``max``, KVzip's statistic; the sum is
        also part of ``mass``); then their own entries are dropped and their columns given back, so the cache holds the
        budget's best entries of the earlier rows and the next token takes the column after them. This is how a
        context-reconstruction pass (KVzip, :mod:`h2o_kv.hf.reconstruct`) scores a prompt for any policy.
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}; got {statistic!r}")
        if self.stepwise or self.streaming or self.kv_bits is not None:
            raise ValueError("a scoring pass needs a plain prompt chunk: not stepwise, streaming or kv_bits")
        self.scoring_rows, self.scoring_statistic = rows, statistic
        try:
            yield self
        finally:
            self.scoring_rows, self.scoring_statistic = 0, "sum"

    # -- policy resolution ----------------------------------------------------------------------------------------
    def _resolve(self, prompt_length: int) -> None:
        if self.policy is None:
            heavy, recent = self.budget.split(prompt_length)
            self.policy = make_policy(self.policy_name, heavy, recent, **self._policy_options)
        capacity = self.policy.capacity
        if self.policy.bounded and capacity >= prompt_length:
            from ..notices import notice

            notice(
                f"H2OCache({self.policy.describe()}): heavy + recent = {capacity} >= the {prompt_length}-token prompt, "
                f"so nothing is evicted until a sequence holds more than {capacity} tokens (until then it behaves "
                "like the full cache)",
                H2OBudgetWarning,
            )

    # -- transformers' Cache contract -----------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(H2OLayer(self))
        if layer_idx == 0 and self.selection_pending:
            self.select_across_layers()
        if layer_idx == 0 and self.layers[0].seen == 0:
            self._resolve(key_states.shape[2] - self.scoring_rows)  # the budget is of the prompt, not its scoring
        return self.layers[layer_idx].update(key_states, value_states)

    def get_mask_sizes(self, query, layer_idx: int = 0) -> tuple[int, int]:
        seen = self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0
        return seen + compat.query_length(query), 0

    def reset(self) -> None:
        self.layers = []
        if self.budget is not None and self.budget.is_ratio:
            self.policy = None

    @property
    def heavy(self) -> int | None:
        return None if self.policy is None else self.policy.heavy

    @property
    def recent(self) -> int | None:
        return None if self.policy is None else self.policy.recent

    def kept_entries(self) -> int:
        """The most entries any (layer, sequence, KV head) holds now."""
        return max((int(layer.entry_count().max()) for layer in self.layers if layer.is_initialized), default=0)

    def stats(self) -> dict[str, Any]:
        """Entries held vs seen and the KV bytes allocated vs a full cache holding every token seen."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        seen = layers[0].seen if layers else 0
        held = self.kept_entries()

        def nbytes(t: torch.Tensor) -> int:
            return t.nbytes() if isinstance(t, QuantizedSlots) else t.numel() * t.element_size()

        def token_bytes(t: torch.Tensor) -> int:  # one token of a full cache in the model's dtype
            return t.shape[0] * t.shape[1] * t.shape[3] * t.dtype.itemsize

        kv_bytes = sum(nbytes(layer.keys) + nbytes(layer.values) for layer in layers)
        per_token = sum(token_bytes(layer.keys) + token_bytes(layer.values) for layer in layers)
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
            "full_kv_bytes": per_token * seen,
            "kv_ratio": kv_bytes / (per_token * seen) if seen else 1.0,
            "kv_bits": self.kv_bits,
        }
