"""Triton kernels over the transformers backend's slot buffer ``[batch, kv_heads, slots, head_dim]``.

One program per (sequence, KV head) row owns every output of its row (no atomics). :func:`slot_step` is the decode
step of :class:`~h2o_kv.hf.cache.H2OLayer` in one kernel: the new token into the row's free slot, attention of the
group's query heads over the valid slots, the probability mass each slot received summed over the group, and for
H2O (Zhang et al., arXiv:2306.14048) the score update and the victim (the first slot of lowest score outside the
recent window); other policies get the mass back. :func:`write_slot` and :func:`h2o_victim` are its first and last
parts alone, with the signatures of the fused CPU kernels (``kernels/cpu/decode_step.cpp``), which is how
``H2OCache`` uses them on CUDA (:func:`h2o_kv.kernels.step_ops`). Arithmetic is fp32 whatever the cache's dtype;
reductions are ``tl.sum`` over broadcasts (a decode step is memory bound, and Triton's interpreter has no bf16
``tl.dot``). References: :mod:`h2o_kv.kernels.triton.reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # slots per iteration


@triton.jit
def _slot_step(
    q_ptr, k_ptr, v_ptr, pos_ptr, score_ptr, valid_ptr, free_ptr, new_k_ptr, new_v_ptr, out_ptr, mass_ptr,
    victim_ptr, column, recent_from, scale, slots, dim, group,
    WRITE: tl.constexpr, ATTEND: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    base = row * slots  # the row's first slot
    free = -1
    if WRITE:  # the new token's key, value, column, validity (read back below from registers, never from memory)
        free = tl.load(free_ptr + row)
        new_k = tl.load(new_k_ptr + row * dim + d, mask=d_ok, other=0.0)
        new_v = tl.load(new_v_ptr + row * dim + d, mask=d_ok, other=0.0)
        tl.store(k_ptr + (base + free) * dim + d, new_k, mask=d_ok)
        tl.store(v_ptr + (base + free) * dim + d, new_v, mask=d_ok)
        tl.store(pos_ptr + base + free, column)
        tl.store(valid_ptr + base + free, 1)
        if not EVICT:  # with EVICT, the slot's score (0 + its mass) is stored once, below
            tl.store(score_ptr + base + free, 0.0)
    if ATTEND:
        q_at = (row * group + g[:, None]) * dim + d[None, :]
        query = tl.load(q_ptr + q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        query = query.to(tl.float32) * scale
        new_kf = new_k.to(tl.float32)
        new_vf = new_v.to(tl.float32)
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for start in range(0, slots, BLOCK_N):  # pass 1: online softmax and the output
            n = start + tl.arange(0, BLOCK_N)
            is_new = n == free
            logits = _logits(query, k_ptr, pos_ptr, valid_ptr, base, n, d, d_ok, g_ok, slots, dim, column, is_new,
                             new_kf)  # fmt: skip
            peak = tl.maximum(m, tl.max(logits, 1))
            shift = tl.where(peak == float("-inf"), 0.0, peak)  # a row that saw nothing yet
            p = tl.exp(logits - shift[:, None])
            alpha = tl.exp(m - shift)
            at = (base + n[:, None]) * dim + d[None, :]
            values = tl.load(v_ptr + at, mask=(n < slots)[:, None] & d_ok[None, :], other=0.0)
            values = tl.where(is_new[:, None], new_vf[None, :], values.to(tl.float32))
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], 1)
            total = total * alpha + tl.sum(p, 1)
            m = peak
        out = acc / total[:, None]
        tl.store(out_ptr + (row * group + g[:, None]) * dim + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
        shift = tl.where(m == float("-inf"), 0.0, m)
    best = float("inf")
    victim = 0
    for start in range(0, slots, BLOCK_N):  # pass 2: the mass, then the score update and the victim
        n = start + tl.arange(0, BLOCK_N)
        inside = n < slots
        is_new = n == free
        if ATTEND:
            logits = _logits(query, k_ptr, pos_ptr, valid_ptr, base, n, d, d_ok, g_ok, slots, dim, column, is_new,
                             new_kf)  # fmt: skip
            mass = tl.sum(tl.exp(logits - shift[:, None]) / total[:, None], 0)
        else:
            mass = tl.load(mass_ptr + base + n, mask=inside, other=0.0)
        if EVICT:
            scores = tl.load(score_ptr + base + n, mask=inside, other=0.0)
            scores = tl.where(is_new, 0.0, scores) + mass
            tl.store(score_ptr + base + n, scores, mask=inside)
            pos = tl.load(pos_ptr + base + n, mask=inside, other=0)
            pos = tl.where(is_new, column, pos)
            # NaN and +inf are never below `best`: the same victim as the CPU kernel's strict `<` scan
            candidate = tl.where(inside & (pos < recent_from) & (scores < float("inf")), scores, float("inf"))
            low = tl.min(candidate, 0)
            first = tl.min(tl.where(candidate == low, n, slots), 0)
            better = low < best
            victim = tl.where(better, first, victim)
            best = tl.where(better, low, best)
        elif ATTEND:
            tl.store(mass_ptr + base + n, mass, mask=inside)
    if EVICT:
        tl.store(victim_ptr + row, victim.to(tl.int64))


@triton.jit
def _logits(query, k_ptr, pos_ptr, valid_ptr, base, n, d, d_ok, g_ok, slots, dim, column, is_new, new_k):
    """Scaled logits ``[BLOCK_G, BLOCK_N]`` of the group's query heads over slots ``n``; -inf where not visible."""
    inside = n < slots
    keys = tl.load(k_ptr + (base + n[:, None]) * dim + d[None, :], mask=inside[:, None] & d_ok[None, :], other=0.0)
    keys = tl.where(is_new[:, None], new_k[None, :], keys.to(tl.float32))
    pos = tl.where(is_new, column, tl.load(pos_ptr + base + n, mask=inside, other=0))
    valid = is_new | (tl.load(valid_ptr + base + n, mask=inside, other=0) != 0)
    visible = inside & valid & (pos <= column)
    logits = tl.sum(query[:, None, :] * keys[None, :, :], 2)
    return tl.where(visible[None, :] & g_ok[:, None], logits, float("-inf"))


def _rows(pos: torch.Tensor) -> int:
    return pos.shape[0] * pos.shape[1]


def _launch(rows, *args, write, attend, evict, dim, group):
    _slot_step[(rows,)](
        *args, WRITE=write, ATTEND=attend, EVICT=evict, BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_G=triton.next_power_of_2(group),
    )  # fmt: skip


def write_slot(keys, values, pos, scores, valid, free, key, value, column: int) -> None:
    """Write one token per (sequence, KV head) into slot ``free[b, h]``: key, value, column, zero score, valid."""
    dim, slots = keys.shape[-1], pos.shape[-1]
    flags = valid.view(torch.uint8)
    _launch(_rows(pos), keys, keys, values, pos, scores, flags, free, key.contiguous(), value.contiguous(), keys,
            scores, pos, int(column), 0, 1.0, slots, dim, 1, write=True, attend=False, evict=False, dim=dim,
            group=1)  # fmt: skip


def h2o_victim(scores, mass, pos, recent_from: int) -> torch.Tensor:
    """``scores += mass`` in place; per row the first slot of lowest score whose column is below ``recent_from``
    (``[batch, heads, 1]`` int64), as ``scores.masked_fill(pos >= recent_from, inf).min(-1).indices``."""
    victim = pos.new_empty((*pos.shape[:2], 1))
    slots = pos.shape[-1]
    _launch(_rows(pos), scores, scores, scores, pos, scores, pos, pos, scores, scores, scores, mass.contiguous(),
            victim, 0, int(recent_from), 1.0, slots, 1, 1, write=False, attend=False, evict=True, dim=1,
            group=1)  # fmt: skip
    return victim


def slot_step(query, keys, values, pos, scores, valid, free, key, value, column: int, scale: float,
              recent_from: int | None = None):  # fmt: skip
    """One decode step of every (sequence, KV head) row, in place: ``key``/``value`` ``[B, H_kv, 1, D]`` into slot
    ``free`` ``[B, H_kv, 1]`` at ``column``; attention of ``query`` ``[B, H_q, 1, D]`` (head ``j`` reads KV head
    ``j // (H_q // H_kv)``) over the valid slots whose column is at most ``column``.

    Returns ``(output [B, 1, H_q, D], mass, victim)``: with ``recent_from`` (H2O) the mass is folded into ``scores``
    (``mass`` is None) and ``victim`` ``[B, H_kv, 1]`` is the first slot of lowest score below that column (not
    freed: the caller clears its ``valid`` flag); without it, ``mass`` ``[B, H_kv, slots]`` fp32 and no victim.
    """
    batch, q_heads, _, dim = query.shape
    group = q_heads // keys.shape[1]
    slots = pos.shape[-1]
    output = query.new_empty(query.shape)
    evict = recent_from is not None
    mass = None if evict else scores.new_empty(scores.shape)
    victim = pos.new_empty((*pos.shape[:2], 1)) if evict else pos
    _launch(_rows(pos), query.contiguous(), keys, values, pos, scores, valid.view(torch.uint8), free.contiguous(),
            key.contiguous(), value.contiguous(), output, scores if mass is None else mass, victim, int(column),
            int(recent_from or 0), float(scale), slots, dim, group, write=True, attend=True, evict=evict, dim=dim,
            group=group)  # fmt: skip
    return output.transpose(1, 2), mass, victim if evict else None
