"""A bounded KV cache for Hugging Face ``transformers`` with real eviction (the transformers backend).

Each layer stores keys and values in a slot buffer ``[batch, kv_heads, slots, head_dim]`` with, per slot, the
absolute column of its entry (``pos``), a validity flag (``valid``) and the policy's running score (``scores``). Keys
stay rotated at their absolute positions, so slots may be in any order: attention is permutation invariant once the
mask is built from ``pos`` and ``valid``. :class:`~h2o_kv.hf.slots.Slots` is that storage; :class:`H2OLayer`
adds the per-step operations.

**The per-step contract** (the whole interface between this module, the attention function
:mod:`h2o_kv.hf.attention` and the policies :mod:`h2o_kv.policies`):

1. transformers calls :meth:`H2OCache.update` with a chunk's new keys and values. The layer returns them unchanged,
   the keys tagged with the layer (:func:`staged_layer` takes the tag off): the model calls its attention function
   right after ``update`` with exactly the returned tensors. Unlike transformers' own caches, ``update`` cannot
   return the entries to attend: a ``stepwise`` chunk writes and attends its tokens one at a time, and streaming
   mode un-rotates the keys with RoPE tables that only the attention function receives.
2. The attention function uses four members of the layer (:data:`ATTENTION_CONTRACT`, checked by
   ``tests/test_contract.py``): ``streaming`` and ``roller`` (streaming mode only, :mod:`h2o_kv.hf.rotary`),
   :meth:`~H2OLayer.steps` and :meth:`~H2OLayer.observe`. ``steps`` yields one frozen :class:`Step` per attention
   call - the whole chunk for a **prompt chunk** (the kept entries followed by the chunk's new ones), one per token
   for a **decode step** (the slots after the token was written into a free one) - and the attention function hands
   each back to ``observe`` with the probability mass every entry received. ``observe`` gives it to the policy
   (:meth:`~h2o_kv.policies.Policy.accumulate`, :meth:`~h2o_kv.policies.Policy.keep_score`) and moves entries: a
   prompt chunk keeps its best ``capacity`` candidates, a decode step frees the lowest-ranked slot once more than
   ``capacity`` entries are held (so ``capacity + 1`` slots suffice).
3. The policy only ranks entries through an :class:`~h2o_kv.policies.EntryView`; this module only moves them.

Two behaviours span steps:

* an across-layers policy (``global_*``) keeps every candidate of a prompt until all layers have scored it; the
  selection (:meth:`H2OCache.select_across_layers`) runs at layer 0 of the *next* forward (or when called);
* a :meth:`H2OCache.scoring_pass` changes state for one forward: its rows score the prompt, then their entries are
  dropped and their columns given back.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from .. import kernels
from ..budget import Budget
from ..policies import Policy, make_policy
from . import compat, quant
from .packed import PackedSlots, padded
from .quant import QuantizedSlots
from .slots import NO_START, Candidates, Slots

STATISTICS = ("sum", "max")  # of a scoring pass's attention (H2O's sum, KVzip's max)
ATTENTION_CONTRACT = frozenset({"streaming", "roller", "steps", "observe"})  # what the attention function uses
_TAG = "_h2o_layer"  # the attribute of the keys H2OLayer.update returns: the layer they belong to


class H2OBudgetWarning(UserWarning):
    """The budget is at least the prompt: nothing is evicted until a sequence outgrows it."""


def staged_layer(key: torch.Tensor) -> H2OLayer | None:
    """The layer whose :meth:`~H2OLayer.update` returned ``key`` (the tag is taken off), or None: the model runs with
    another cache (or changed the keys after the cache, which the next ``update`` refuses)."""
    return key.__dict__.pop(_TAG, None)


@dataclass(frozen=True)
class Step:
    """One attention call over one layer's entries, from :meth:`H2OLayer.steps` back to :meth:`H2OLayer.observe`.

    Shapes ``[batch, kv_heads, entries(, head_dim)]``; ``keys``/``values`` are :class:`QuantizedSlots` with
    ``kv_bits`` (a decode step; a prompt chunk's candidates are read back in full precision).
    """

    keys: torch.Tensor | QuantizedSlots  # what attention reads (raw, before RoPE, in streaming mode)
    values: torch.Tensor | QuantizedSlots
    pos: torch.Tensor  # absolute column of each entry
    valid: torch.Tensor  # False: a free slot or padding
    all_valid: bool  # every entry valid and in the rows' past (but a prompt chunk's own): no mask needed
    first_column: int  # column of the call's first query row
    rows: slice  # the query rows of this call (a prompt chunk: all; a decode step: its one token)
    chunk_start: int | None  # a prompt chunk: index of its first own entry (the entries end with them); else None
    need_mass: bool  # compute ``mass``/``last`` at all (the policy reads attention)
    window: int  # ``last`` is over the call's last ``window`` rows
    window_max: bool  # ``last`` is their largest probability (KVzip), not their sum
    chunk_bytes: int  # bound on the attention scores held at once
    candidates: Candidates | None = field(default=None, repr=False)  # a prompt chunk's, for observe()

    @property
    def is_prompt(self) -> bool:
        return self.chunk_start is not None


class H2OLayer(Slots):
    """One layer of an :class:`H2OCache`: the per-step operations over its :class:`Slots` (the module docstring).
    The policy ranks entries; this class only moves them."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Return the chunk unchanged, the keys tagged with this layer for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        setattr(key_states, _TAG, self)
        return key_states, value_states

    # -- what the attention function uses (ATTENTION_CONTRACT) --------------------------------------------------
    @property
    def streaming(self) -> bool:
        """Keys are stored before RoPE and re-rotated at their rank inside the cache (:mod:`h2o_kv.hf.rotary`)."""
        return self.cache.streaming

    def roller(self, module: torch.nn.Module, query: torch.Tensor, rope, is_real: torch.Tensor | None):
        """Streaming mode: the :class:`~h2o_kv.hf.rotary.PositionRoller` of one attention call on this layer."""
        from .rotary import PositionRoller

        return PositionRoller(module, self, query, rope, is_real)

    def steps(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor | None) -> Iterator[Step]:
        """The attention calls of a chunk ``[batch, kv_heads, c, head_dim]`` (``is_real [batch, c]``: False for
        padding): one :class:`Step` over the candidates for a prompt chunk, else one per token over the slots after
        the token was written. Each step must be given back to :meth:`observe` before the next is drawn."""
        self.cache.claimed(self)
        policy, chunk_bytes = self.cache.policy, self.cache.prefill_chunk_bytes
        rows = keys.shape[2]
        if rows > 1 and not self.cache.stepwise:
            chunk = self.candidates(keys, values, is_real)
            scoring = self.cache.scoring_rows
            yield Step(
                chunk.keys, chunk.values, chunk.pos, chunk.valid, bool(chunk.valid.all()), self.seen - rows,
                slice(None), chunk.keys.shape[2] - rows, policy.needs_attention,
                scoring or policy.observation_window, scoring > 0 and self.cache.scoring_statistic == "max",
                chunk_bytes, chunk,
            )  # fmt: skip
            return
        if rows > 1:
            self.reserve(rows)
        for i in range(rows):
            self.append(keys[:, :, i : i + 1], values[:, :, i : i + 1], None if is_real is None else is_real[:, i])
            yield Step(padded(self.keys), padded(self.values), self.pos, self.valid, self.full, self.seen - 1,
                       slice(i, i + 1), None, policy.needs_attention, 1, False, chunk_bytes)  # fmt: skip

    def observe(self, step: Step, mass: torch.Tensor | None, last: torch.Tensor | None) -> None:
        """Take a step back with the mass its entries received (``mass``: summed over the rows and the query heads of
        each KV group; ``last``: over the last ``step.window`` rows): a prompt chunk keeps its best candidates
        (:meth:`keep`), a decode step evicts (:meth:`evict`)."""
        if step.is_prompt:
            self.keep(step.candidates, mass, last)
        else:
            self.evict(mass, last)

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
            keys, values = torch.cat([padded(self.keys), keys], dim=2), torch.cat([padded(self.values), values], dim=2)
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
            if isinstance(self.keys, PackedSlots):
                self.grow_segments()
            elif self.slots < self.max_slots and int(self.entry_count().max()) >= self.slots:
                self._resize(self.slots + 1)  # grow as a plain cache does: never more slots than entries + 1
            free = self.valid.byte().argmin(-1, keepdim=True)  # [batch, heads, 1]: the first free slot
        real = None if is_real is None or bool(is_real.all()) else is_real
        own_write = isinstance(self.keys, (QuantizedSlots, PackedSlots))  # the fused write is for plain buffers
        ops = None if own_write else kernels.step_ops(self.keys, self.values, self.pos, self.scores, self.valid, free)
        if ops is not None:  # one fused pass for the five writes below
            ops.write_slot(self.keys, self.values, self.pos, self.scores, self.valid, free, key.contiguous(),
                           value.contiguous(), self.seen)  # fmt: skip
        else:
            for buffer, new in ((self.keys, key), (self.values, value)):
                if own_write:
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
            self.note_peak(self.slots if self.full else None)
            return
        capacity = self.capacity()
        if self.full and self.slots > policy.capacity:  # steady state: every slot valid, all over the budget
            self.note_peak(self.slots)
            self.scores, victim = policy.decode_victim(self.view(), mass, last)
            self.valid.scatter_(2, victim, False)
            self._free, self.full = victim, False  # the victim is now the only free slot
            return
        self.scores = policy.accumulate(self.scores, mass, last)
        self.note_peak()
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
        min_entries: with ``budget``, a floor of kept entries (:class:`h2o_kv.Budget`); None (default): none.
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
        packed: once a head-adaptive or across-layers policy has given its KV heads unequal counts, store each
            head's entries (and its one free slot) as its own segment, so the bytes allocated are the entries kept
            (:mod:`h2o_kv.hf.packed`; default). False: pad each layer to its largest head (the same outputs, bit
            for bit; more memory). With ``kv_bits`` the layout stays padded.

    The model's attention implementation must be ``"h2o"``: ``h2o_kv.load_model`` sets it, and
    ``h2o_kv.enable_h2o(model)`` does it for a model loaded with plain ``transformers``.
    """

    def __init__(
        self,
        heavy: int | None = None,
        recent: int | None = None,
        *,
        budget: float | None = None,
        min_entries: int | None = None,
        policy: str | Policy = "h2o",
        prefill_chunk_mb: float = 64.0,
        stepwise: bool = False,
        streaming: bool = False,
        kv_bits: int | None = None,
        kv_group_size: int = quant.DEFAULT_GROUP,
        kv_residual: int = quant.DEFAULT_RESIDUAL,
        packed: bool = True,
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
        self.packed = bool(packed)
        self.budget: Budget | None = None
        if isinstance(policy, Policy):
            if heavy is not None or recent is not None or budget is not None or min_entries or policy_options:
                raise ValueError("pass the budget inside the Policy object or as heavy/recent/budget, not both")
            self.policy_name, self._policy_options, self.policy = policy.name, {}, policy
        else:
            self.policy_name, self._policy_options = policy, policy_options
            probe = make_policy(policy, 0, 0, **policy_options)  # validates the name and options early
            if probe.bounded:
                self.budget = Budget.of(budget, heavy, recent, min_entries)
                self.policy = None if self.budget.is_ratio else make_policy(policy, heavy, recent, **policy_options)
            elif heavy is not None or recent is not None or budget is not None or min_entries:
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
        self._unclaimed: H2OLayer | None = None  # the layer whose staged chunk no attention function took yet

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
            chunk = Candidates(padded(layer.keys), padded(layer.values), layer.pos, layer.valid.clone(), layer.scores)
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
        """Stage a chunk for the attention function (see the module docstring); returns it unchanged."""
        if self._unclaimed is not None:
            self._unclaimed = None
            raise RuntimeError(
                "H2OCache was updated twice without its attention function running: the model's attention "
                "implementation must be 'h2o' and must receive the keys H2OCache.update returned. Call "
                "h2o_kv.enable_h2o(model) (h2o_kv.load_model does it)."
            )
        while len(self.layers) <= layer_idx:
            self.layers.append(H2OLayer(self))
        if layer_idx == 0 and self.selection_pending:
            self.select_across_layers()
        if layer_idx == 0 and self.layers[0].seen == 0:
            self._resolve(key_states.shape[2] - self.scoring_rows)  # the budget is of the prompt, not its scoring
        self._unclaimed = self.layers[layer_idx]
        return self._unclaimed.update(key_states, value_states)

    def claimed(self, layer: H2OLayer) -> None:
        """The attention function took ``layer``'s staged chunk (:meth:`H2OLayer.steps`)."""
        if self._unclaimed is layer:
            self._unclaimed = None

    def get_mask_sizes(self, query, layer_idx: int = 0) -> tuple[int, int]:
        seen = self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0
        return seen + compat.query_length(query), 0

    def reset(self) -> None:
        """Forget every entry (the next forward starts a new prompt; a ratio budget is resolved again)."""
        self.layers = []
        self.selection_pending, self._unclaimed = False, None
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

    def mean_entries(self) -> float:
        """Entries held per (layer, sequence, KV head), averaged: what a cache packed per head allocates, and the
        count kvpress' presses are matched at (a global or head-adaptive policy holds unequal counts)."""
        counts = [layer.entry_count().double().mean() for layer in self.layers if layer.is_initialized]
        return float(sum(counts) / len(counts)) if counts else 0.0

    def stats(self) -> dict[str, Any]:
        """Entries held vs seen and the KV bytes allocated vs a full cache holding every token seen."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        seen = layers[0].seen if layers else 0
        held = self.kept_entries()

        def nbytes(t: torch.Tensor) -> int:
            return t.nbytes() if isinstance(t, (QuantizedSlots, PackedSlots)) else t.numel() * t.element_size()

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
