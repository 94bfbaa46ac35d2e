"""A slow, plain H2O to check the library against: batch 1, eager attention, eviction by masking.

Nothing here is shared with ``h2o_kv``: keys and values stay in a stock ``DynamicCache`` (full size), and each
layer keeps a boolean ``kept`` row per KV head plus float64 scores. Every forward:

* attention is eager ``softmax(q k^T * scale)`` over the kept columns and the causal part of the chunk
  (GQA: keys repeated per query head, probabilities summed over the query heads of a group);
* scores += the probabilities each column received;
* a multi-token chunk (a prompt) is then cut to ``heavy + recent``: the last ``recent`` columns plus the
  ``heavy`` best-scored others; a single token (a decode step) evicts the lowest-scored column outside the
  last ``recent`` if more than ``heavy + recent`` are kept. ``local`` and ``sink`` rank by recency instead
  (``sink`` always keeps the first ``sinks`` columns); ``tova`` ranks by the last query row only; ``a2sf`` is
  ``h2o`` with ``scores = decay * scores + probs``.

With ``kv_bits`` (``H2OCache(kv_bits=...)``'s storage, written out plainly): attention reads each column's key and
value through a min/max round trip (``kv_group`` numbers per scale and zero point) unless the column belongs to the
step (its own entries) or to the newest ``max(kv_residual, 1)`` columns stored when the step attends. With
``streaming``: keys are un-rotated to raw ones (quantized raw), then rotated at their rank among the kept columns,
queries at the rank of their own column (StreamingLLM positions); the un-rotation is h2o-kv's own (``_raw``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from h2o_kv.hf.compat import cache_kwargs

NAME = "h2o_reference"


class ReferenceState:
    def __init__(
        self, heavy: int, recent: int, policy: str = "h2o", sinks: int = 4, stepwise: bool = False,
        kv_bits: int | None = None, kv_group: int = 64, kv_residual: int = 64, rotary=None, decay: float = 1.0,
    ):  # fmt: skip
        self.heavy, self.recent, self.policy, self.sinks, self.stepwise = heavy, recent, policy, sinks, stepwise
        self.kv_bits, self.kv_group, self.kv_residual = kv_bits, kv_group, kv_residual
        self.rotary = rotary  # the model's rotary embedding: streaming positions
        self.decay = decay
        self.kept: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, columns] bool
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, columns] float64

    def rank(self, layer: int, columns: int, last_row: torch.Tensor | None) -> torch.Tensor:
        """Higher is kept. ``last_row``: the newest query's probabilities (tova)."""
        position = torch.arange(columns, dtype=torch.float64).expand_as(self.scores[layer])
        if self.policy in ("h2o", "a2sf"):
            rank = self.scores[layer].clone()
            rank[:, columns - self.recent :] = float("inf")
        elif self.policy == "h2o_mean":  # summed attention / number of queries that saw the column
            rank = self.scores[layer] / (columns - position)
            rank[:, columns - self.recent :] = float("inf")
        elif self.policy == "local":
            rank = position.clone()
        elif self.policy == "sink":
            rank = position.clone()
            rank[:, : self.sinks] = float("inf")
        elif self.policy == "tova":
            rank = last_row.clone()
        else:
            raise ValueError(self.policy)
        return rank.masked_fill(~self.kept[layer], float("-inf"))


STATE: ReferenceState | None = None


def round_trip(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric min/max quantization of each ``group`` numbers of the last dimension, and back."""
    g = x.float().unflatten(-1, (-1, group))
    low = g.amin(-1, keepdim=True)
    scale = (g.amax(-1, keepdim=True) - low) / (2**bits - 1)
    codes = ((g - low) / scale.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(0, 2**bits - 1)
    return (codes * scale + low).flatten(-2).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(state: ReferenceState, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [1, H, N, D]`` rotated at ``positions [H, N]``."""
    cos, sin = state.rotary(x, positions.reshape(1, -1))
    cos, sin = cos.view(*positions.shape, -1).unsqueeze(0), sin.view(*positions.shape, -1).unsqueeze(0)
    return x * cos + _rotate_half(x) * sin


def _raw(state: ReferenceState, x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``x`` un-rotated from ``columns``: h2o-kv's own un-rotation (tested in test_streaming.py), so that raw keys
    are bitwise the cache's and no code flips at a rounding boundary; back in the model's dimension order."""
    from h2o_kv.hf.rotary import pair_order, raw_keys

    cos, sin = state.rotary(x, columns.view(1, -1))
    order = pair_order(x.shape[-1], cos.shape[-1])
    return raw_keys(x, cos, sin).index_select(-1, order.argsort())


def _stored(state: ReferenceState, query, key, value, old: int, r0: int, r1: int, layer: int):
    """The query rows and the keys/values the step attends to under quantization and streaming."""
    columns = key.shape[2]
    if state.rotary is not None:  # raw keys and queries (the model rotated them at their absolute columns)
        key, query = _raw(state, key, torch.arange(columns)), _raw(state, query, torch.arange(old + r0, old + r1))
    if state.kv_bits is not None:
        exact_from = old + r0 + 1 - max(state.kv_residual, 1) if r1 - r0 == 1 else old - max(state.kv_residual, 1)
        exact = (torch.arange(columns) >= exact_from).view(1, 1, -1, 1)
        key = torch.where(exact, key, round_trip(key, state.kv_bits, state.kv_group))
        value = torch.where(exact, value, round_trip(value, state.kv_bits, state.kv_group))
    if state.rotary is not None:  # every column at its rank among the kept ones
        kept = state.kept[layer][:, :columns].long()
        rank = kept.cumsum(-1) - kept  # kept columns before each column
        key = _rope(state, key, rank)
        group = query.shape[1] // key.shape[1]
        query = _rope(state, query, rank[:, old + r0 : old + r1].repeat_interleave(group, dim=0))
    return query, key, value


def _attend(module, query, key, value, scaling, rows_start, state: ReferenceState, layer: int):
    """Eager attention of query rows at columns rows_start.. over the kept columns; returns out and probs."""
    columns = key.shape[2]
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    logits = (query.float() @ k.transpose(2, 3)) * scaling  # [1, Hq, rows, columns]
    row_columns = torch.arange(rows_start, rows_start + query.shape[2]).view(-1, 1)
    visible = (torch.arange(columns).view(1, -1) <= row_columns) & state.kept[layer].repeat_interleave(
        group, dim=0
    ).unsqueeze(1)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs @ v, probs


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state, layer = STATE, module.layer_idx
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    rows, columns, kv_heads = query.shape[2], key.shape[2], key.shape[1]
    group = query.shape[1] // kv_heads
    budget = state.heavy + state.recent
    old = columns - rows
    if layer not in state.kept:
        state.kept[layer] = torch.zeros(kv_heads, 0, dtype=torch.bool)
        state.scores[layer] = torch.zeros(kv_heads, 0, dtype=torch.float64)
    steps = [(i, i + 1) for i in range(rows)] if (state.stepwise or rows == 1) else [(0, rows)]
    outputs = []
    for r0, r1 in steps:
        # the columns of this step become kept (the rest of the chunk is not visible yet anyway)
        state.kept[layer] = torch.cat([state.kept[layer], torch.ones(kv_heads, r1 - r0, dtype=torch.bool)], 1)
        state.scores[layer] = torch.cat([state.scores[layer], torch.zeros(kv_heads, r1 - r0, dtype=torch.float64)], 1)
        visible_columns = old + r1
        step_query, step_key, step_value = _stored(
            state, query[:, :, r0:r1], key[:, :, :visible_columns], value[:, :, :visible_columns], old, r0, r1, layer
        )
        out, probs = _attend(module, step_query, step_key, step_value, scaling, old + r0, state, layer)
        outputs.append(out)
        per_kv = probs[0].double().view(kv_heads, group, r1 - r0, visible_columns)
        state.scores[layer] = state.scores[layer] * state.decay + per_kv.sum(dim=(1, 2))
        last_row = per_kv[:, :, -1].sum(1)
        if state.policy == "tova":
            state.scores[layer] = last_row.clone()
        kept = state.kept[layer]
        for head in range(kv_heads):
            while int(kept[head].sum()) > budget:
                rank = state.rank(layer, visible_columns, last_row)[head]
                if r1 - r0 > 1:  # a prompt chunk: keep the best `budget` columns at once
                    keep = rank.topk(budget).indices
                    kept[head] = False
                    kept[head, keep] = True
                else:  # a decode step: evict the single lowest
                    rank = rank.masked_fill(~kept[head], float("inf"))
                    kept[head, int(rank.argmin())] = False
    out = torch.cat(outputs, dim=2)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


AttentionInterface.register(NAME, reference_attention)
AttentionMaskInterface.register(NAME, _no_mask)


@torch.no_grad()
def reference_generate(model, input_ids, max_new_tokens, heavy, recent, policy="h2o", turns=(), **options):
    """Greedy decoding under the reference H2O, one token per forward after the prompt.

    ``turns``: further token lists appended (as one chunk each) after the previous turn's generation, like a
    multi-turn chat on one cache. End-of-sequence tokens are never chosen (as ``min_new_tokens`` does).
    ``options``: ``kv_bits``, ``kv_group``, ``kv_residual``, ``streaming`` (see the module docstring), ``decay`` (a2sf).
    Returns (generated token ids per turn, raw logits per generated token).
    """
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    global STATE
    STATE = _state(model, heavy, recent, policy, **options)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        cache = DynamicCache()
        generated, all_logits = [], []
        chunk = input_ids
        for turn in [None, *turns]:
            if turn is not None:
                chunk = torch.cat([chunk, torch.tensor([turn])], dim=1)
            tokens = []
            for _ in range(max_new_tokens):
                logits = model(chunk, **cache_kwargs(cache), use_cache=True).logits[:, -1]
                all_logits.append(logits[0])
                chunk = logits.index_fill(-1, torch.tensor(eos, dtype=torch.long), float("-inf")).argmax(
                    -1, keepdim=True
                )
                tokens.append(int(chunk))
            generated.append(tokens)
        return generated, torch.stack(all_logits)
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def reference_logits(model, input_ids, heavy, recent, policy="h2o", stepwise=True, **options):
    """Teacher-forced logits of ``input_ids`` fed one token at a time under the reference H2O."""
    global STATE
    STATE = _state(model, heavy, recent, policy, stepwise=stepwise, **options)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        return model(input_ids, **cache_kwargs(DynamicCache()), use_cache=True).logits[0]
    finally:
        model.set_attn_implementation(previous)


def _state(model, heavy, recent, policy, streaming=False, **options) -> ReferenceState:
    rotary = model.model.rotary_emb if streaming else None
    return ReferenceState(heavy, recent, policy, rotary=rotary, **options)
