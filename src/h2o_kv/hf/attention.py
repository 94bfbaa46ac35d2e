"""The ``"h2o"`` attention function: attention outputs plus the probability mass each key received.

Registered with transformers' ``AttentionInterface`` (and a matching ``AttentionMaskInterface`` entry), it runs
inside every attention module of a supported model. Its whole use of an H2O cache (:mod:`h2o_kv.hf.cache`):

1. :func:`~h2o_kv.hf.cache.staged_layer` - the layer whose ``update`` returned these keys (none: plain SDPA, so an
   enabled model behaves exactly as before with any other cache);
2. in streaming mode (``layer.streaming``) a ``layer.roller`` re-rotates queries and keys inside the cache;
3. for each :class:`~h2o_kv.hf.cache.Step` of ``layer.steps(keys, values, is_real)`` (a prompt chunk: one; a decode
   step or stepwise chunk: one per token) it attends over ``step.keys``/``step.values`` at columns ``step.pos``,
   masked by ``step.valid`` unless ``step.all_valid``, computing softmax probabilities explicitly (SDPA and
   FlashAttention never return them), and hands the step back with each entry's probability mass:
   ``layer.observe(step, mass, last)``. That call changes the layer (entries kept or evicted, scores updated).

The mask function builds nothing: it returns a :class:`DeferredMask` carrying the 2D padding mask, which is all an
H2O layer needs; only the SDPA fallback materialises transformers' own mask from it. Prompts are walked in query
blocks: at most ``H2OCache.prefill_chunk_mb`` of scores exist at a time, so no ``L x L`` matrix ever exists.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import Step, staged_layer
from .quant import QuantizedSlots, attend_step
from .rotary import PositionRoller, raw_keys, rope_at

ATTENTION_NAME = "h2o"


def attention_with_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor | None,
    first_column: int,
    scaling: float,
    *,
    query_valid: torch.Tensor | None = None,
    sliding_window: int | None = None,
    need_mass: bool = True,
    window: int = 1,
    window_max: bool = False,
    chunk_bytes: int = 64 * 2**20,
    chunk_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Causal attention of ``query`` over entries at arbitrary columns, with per-key probability mass.

    Shapes: ``query [B, Hq, Q, D]`` (row ``i`` sits at column ``first_column + i``), ``keys/values
    [B, Hkv, N, D]``, ``key_pos/key_valid [B, Hkv, N]``, ``query_valid [B, Q]`` (False rows are padding and
    add no mass). Query head ``j`` reads KV head ``j // (Hq // Hkv)`` (GQA). A key is visible to a row when it
    is valid and not in the row's future (and inside ``sliding_window``); a row always sees its own key.
    ``chunk_start``: when the entries end with the query rows' own keys (entry ``chunk_start + i`` is row ``i``'s),
    each block of rows only reads the entries it can see, which halves the work of a causal prompt.
    ``key_valid=None`` states that every entry is valid and none lies in a row's future, except a row's later
    chunk entries when ``chunk_start`` is given (a decode step over full slots, a prompt without padding): the
    mask is then only the causal triangle of the chunk, and ``key_pos`` is not read (unless ``sliding_window``).

    Rows are processed in blocks of at most ``chunk_bytes`` of scores (fp32 logits and probabilities); with
    ``chunk_start`` a block takes as many rows as fit, given the entries its rows see. When there are several blocks
    they all write their logits into one buffer (softmaxed in place there): blocks of tens of MB allocated one by
    one are fresh ``mmap``s whose page faults cost about as much as the matmul that fills them.

    Returns ``(output [B, Q, Hq, Dv], mass [B, Hkv, N], last [B, Hkv, N])``: ``mass`` is the probability
    summed over the group's query heads and all real rows, ``last`` the same over the last ``window`` rows only
    (float32; TOVA uses the last row, SnapKV an observation window), or with ``window_max`` their maximum over those
    rows and the group's heads (KVzip's statistic).
    """
    batch, q_heads, rows, dim = query.shape
    kv_heads, entries = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    # rows in (row, query head) order, scaled once: a block of rows is a contiguous [B, Hkv, r * group, D] view
    grouped = query.new_empty((batch, kv_heads, rows, group, dim))
    torch.mul(query.view(batch, kv_heads, group, rows, dim).transpose(2, 3), scaling, out=grouped)
    keys_t = keys.transpose(2, 3)
    output = query.new_empty((batch, kv_heads, rows, group, values.shape[-1]))
    if key_valid is None and sliding_window is not None:
        key_valid = torch.ones_like(key_pos, dtype=torch.bool)  # the window needs the general mask
    if query_valid is not None and bool(query_valid.all()):
        query_valid = None
    cells = max(1, chunk_bytes // (8 * batch * q_heads))  # (row, entry) pairs per block: fp32 logits + probs
    mass = last = triangle = scratch = None
    r0 = 0
    while r0 < rows:
        r1 = r0 + _block_rows(cells, entries if chunk_start is None else None, (chunk_start or 0) + r0, rows - r0)
        n = r1 - r0
        seen = entries if chunk_start is None else chunk_start + r1  # the entries this block can see
        block_query = grouped[:, :, r0:r1].view(batch, kv_heads, n * group, dim)
        size = batch * kv_heads * n * group * seen
        if r1 < rows or scratch is not None:  # one of several blocks: reuse one buffer (a block holds <= cells/head)
            if scratch is None or scratch.numel() < size:
                scratch = query.new_empty(max(size, min(cells, rows * entries) * batch * q_heads))
            logits = scratch[:size].view(batch, kv_heads, n * group, seen)
            torch.matmul(block_query, keys_t[..., :seen], out=logits)
        else:
            logits = torch.matmul(block_query, keys_t[..., :seen])
        by_row = logits.view(batch, kv_heads, n, group, seen)
        if key_valid is not None:
            pos = key_pos[:, :, None, None, :seen]  # [B, Hkv, 1, 1, seen]
            columns = torch.arange(first_column + r0, first_column + r1, device=query.device).view(1, 1, -1, 1, 1)
            visible = (key_valid[:, :, None, None, :seen] & (pos <= columns)) | (pos == columns)  # [B, Hkv, n, 1, seen]
            if sliding_window is not None:
                visible &= pos > columns - sliding_window
            by_row.masked_fill_(~visible, float("-inf"))
        elif chunk_start is not None:  # only the block's own keys can lie in its future: an upper triangle
            if triangle is None or triangle.shape[0] < n:
                triangle = torch.ones((n, n), dtype=torch.bool, device=query.device).triu_(1)
            by_row[..., chunk_start + r0 : seen].masked_fill_(triangle[:n, None, :n], float("-inf"))
        if logits.dtype == torch.float32 and logits.device.type == "cpu":  # in place: half the memory traffic
            probs = torch.softmax(logits, dim=-1, out=logits)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        block_out = output[:, :, r0:r1].view(batch, kv_heads, n * group, -1)
        torch.matmul(probs.to(values.dtype), values[:, :, :seen], out=block_out)
        if need_mass:  # column sums as a weighted GEMV: padded rows weigh 0, no thread-parallel reduction
            if query_valid is None:
                weights = probs.new_ones((1, 1, 1, n * group))
            else:
                weights = query_valid[:, r0:r1, None].expand(batch, n, group).reshape(batch, 1, 1, n * group)
                weights = weights.to(probs.dtype)
            chunk_mass = torch.matmul(weights, probs).squeeze(2)
            mass = _accumulate(mass, chunk_mass, entries)
            if window_max and r1 > rows - window:  # the window's largest probability of each entry
                peak = probs.view(batch, kv_heads, n, group, seen)[:, :, max(0, rows - window - r0) :]
                if query_valid is not None:
                    peak = peak * query_valid[:, None, max(r0, rows - window) : r1, None, None]
                peak = peak.amax(dim=(2, 3))
                peak = peak if seen == entries else torch.nn.functional.pad(peak, (0, entries - seen))
                last = peak if last is None else torch.maximum(last, peak)
            elif r1 > rows - window:  # a block inside the window (e.g. a decode step) reuses its sum
                if r0 >= rows - window:  # a copy when later blocks will add to `mass` in place
                    in_window = chunk_mass if r1 == rows else chunk_mass.clone()
                else:
                    weights = weights.clone()
                    weights[..., : (rows - window - r0) * group] = 0
                    in_window = torch.matmul(weights, probs).squeeze(2)
                last = _accumulate(last, in_window, entries)
        r0 = r1
    return output.transpose(1, 2).reshape(batch, rows, q_heads, -1), mass, last


def _block_rows(cells: int, entries: int | None, seen_before: int, left: int) -> int:
    """Rows of the next query block, so that rows x entries seen stays within ``cells`` (at least one row).

    ``entries``: every row sees that many entries; ``None``: a causal chunk, where the block's ``r`` rows see
    ``seen_before + r`` entries (the largest ``r`` with ``r * (seen_before + r) <= cells``).
    """
    if entries is not None:
        r = cells // max(1, entries)
    else:
        r = (math.isqrt(seen_before * seen_before + 4 * cells) - seen_before) // 2
    return max(1, min(left, r))


def _accumulate(total: torch.Tensor | None, part: torch.Tensor, entries: int) -> torch.Tensor:
    """``total + part`` where ``part`` covers the first ``part.shape[-1]`` of ``entries`` entries."""
    if total is None:
        return part if part.shape[-1] == entries else torch.nn.functional.pad(part, (0, entries - part.shape[-1]))
    total[..., : part.shape[-1]] += part
    return total


def h2o_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for an ``H2OCache`` layer, or SDPA when no H2O cache is in use."""
    layer = staged_layer(key)
    if layer is None:
        mask = attention_mask.sdpa() if isinstance(attention_mask, DeferredMask) else attention_mask
        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)
    rows = query.shape[2]
    padding = attention_mask.padding if isinstance(attention_mask, DeferredMask) else attention_mask
    if padding is not None and padding.dim() != 2:
        raise RuntimeError("the 'h2o' attention expects the 2D padding mask built by its mask function")
    is_real = None if padding is None else padding[:, -rows:].to(torch.bool)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    roll = None
    if layer.streaming:  # keys stored before RoPE, re-rotated inside the cache (h2o_kv.hf.rotary)
        rope = rope_at(module, kwargs.get("position_ids"), query)
        roll = layer.roller(module, query, rope, is_real)
        key = raw_keys(key, *rope)
        sliding_window = roll.sliding_window(sliding_window)
    outputs = []
    for step in layer.steps(key, value, is_real):  # a prompt chunk at once, or its tokens one by one
        output, mass, last = _attend(step, query, is_real, scaling, sliding_window, roll)
        layer.observe(step, mass, last)
        outputs.append(output)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _attend(step: Step, query, is_real, scaling: float, sliding_window: int | None, roll: PositionRoller | None):
    """One :class:`~h2o_kv.hf.cache.Step`'s attention: ``(output, mass, last)`` as :func:`attention_with_mass`."""
    key_valid = None if step.all_valid else step.valid
    if step.is_prompt:
        keys = step.keys
        if roll is not None:  # streaming: queries and keys at their positions inside the cache
            query, keys = roll.chunk(keys, step.pos, step.valid, step.first_column)
        return attention_with_mass(
            query, keys, step.values, step.pos, key_valid, step.first_column, scaling,
            query_valid=is_real, sliding_window=sliding_window, need_mass=step.need_mass, window=step.window,
            window_max=step.window_max, chunk_bytes=step.chunk_bytes, chunk_start=step.chunk_start,
        )  # fmt: skip
    i = step.rows.start
    if isinstance(step.keys, QuantizedSlots):  # kv_bits: slots dequantized block by block (hf/quant.py)
        step_query, factors = (query[:, :, i : i + 1], None) if roll is None else roll.step_factors(i, step)
        return attend_step(
            step_query, step.keys, step.values, step.pos, key_valid, step.first_column, scaling,
            sliding_window=sliding_window, key_factors=factors, need_mass=step.need_mass,
        )  # fmt: skip
    step_query, keys = (query[:, :, i : i + 1], step.keys) if roll is None else roll.step(i, step)
    return attention_with_mass(
        step_query, keys, step.values, step.pos, key_valid, step.first_column, scaling,
        sliding_window=sliding_window, need_mass=step.need_mass, window=step.window, chunk_bytes=step.chunk_bytes,
    )  # fmt: skip


class DeferredMask:
    """What the ``"h2o"`` mask function returns: the 2D padding mask, and transformers' own mask on demand.

    An H2O layer only needs ``padding`` (``[batch, columns]``, False for pad tokens, or None). The SDPA fallback (a
    model enabled for h2o running with another cache) calls :meth:`sdpa`, which builds the mask transformers would
    have built, with the same arguments, once per forward.
    """

    def __init__(self, padding: torch.Tensor | None, mask_arguments: dict):
        self.padding = padding
        self._arguments = mask_arguments
        self._built = False
        self._mask = None

    def sdpa(self):
        if not self._built:
            self._mask, self._built = sdpa_mask(**self._arguments), True
        return self._mask


def h2o_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> DeferredMask:
    """The ``"h2o"`` mask function: defers the mask (see :class:`DeferredMask`)."""
    return DeferredMask(attention_mask, dict(kwargs, attention_mask=attention_mask))


def register_attention() -> str:
    """Register the ``"h2o"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, h2o_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, h2o_mask)
    return ATTENTION_NAME
