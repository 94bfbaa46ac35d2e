"""The decode step of bounded requests over vLLM's GPU paged KV cache, as one Triton kernel.

The cache is one layer's key and value caches as the FLASH_ATTN and TRITON_ATTN backends hand them to their kernels:
two ``[num_blocks, block_size, num_kv_heads, head_size]`` views with any strides but a contiguous last axis (vLLM
0.32's ``kv_cache.transpose(1, 2).split(head_size, -1)`` of its ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` tensor, or ``kv_cache.unbind(0)`` of the older ``[2, num_blocks, block_size, num_kv_heads,
head_size]``); fp16/bf16, or fp32. Each request's blocks are listed by its row of ``block_table``. As in the CPU
plugin (:mod:`h2o_kv.vllm.attention`, ``kernels/cpu/paged_decode.cpp``) a request's slots are its first physical cache
slots and each KV head orders its own entries: per-slot columns, scores (fp32) and validity live in fixed
``[requests, num_kv_heads, width]`` pools, a request's state found by its row of ``meta``. One program per
(row, KV head) owns all its outputs (no atomics):

1. the new token's key and value go into the head's first free slot (its column, a zero score);
2. attention of the group's query heads over the visible slots (fp32 online softmax), the output in its dtype;
3. the mass (probability summed over the group's query heads) is written to ``mass`` (any policy, ranked by the
   caller), or - H2O (Zhang et al., arXiv:2306.14048), ``mass=None`` - added to the scores, and where the row evicts
   the first slot of lowest score below its recent window is freed, the victim of
   :meth:`h2o_kv.policies.H2O.decode_victim`.

``meta`` is int64 ``[rows, 6]``: the row's token in the flattened batch, its slot count (0: a padding row, left
alone), the new token's column, whether it evicts, its first protected column (H2O's recent window), its state row in
the pools. The launch reads nothing back to the host, so it can be captured in a CUDA graph. Reference:
:func:`h2o_kv.kernels.triton.reference.paged_step`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # slots per iteration
META = 6


@triton.jit
def _paged_step(
    q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, out_ptr, table_ptr, meta_ptr, pos_ptr, score_ptr,
    valid_ptr, mass_ptr, scale, q_stride, k_stride, v_stride, out_stride, kc_block, kc_token, kc_head, vc_block,
    vc_token, vc_head, width, state_width, mass_width, block_size, kv_heads, dim, group,
    FUSED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    token = tl.load(meta_ptr + r * 6)
    slots = tl.load(meta_ptr + r * 6 + 1)
    if slots <= 0:  # a padding row (a CUDA graph's batch padded to its captured size): nothing to do
        return
    column = tl.load(meta_ptr + r * 6 + 2)
    evicts = tl.load(meta_ptr + r * 6 + 3) != 0
    recent_from = tl.load(meta_ptr + r * 6 + 4)
    state = (tl.load(meta_ptr + r * 6 + 5) * kv_heads + h) * state_width  # this head's first slot in the pools
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    free = slots
    for start in range(0, slots, BLOCK_N):  # the head's first free slot
        n = start + tl.arange(0, BLOCK_N)
        taken = tl.load(valid_ptr + state + n, mask=n < slots, other=1) != 0
        free = tl.minimum(free, tl.min(tl.where(taken, slots, n), 0))
    tl.device_assert(free < slots, "paged_step: no free slot in a decode step")
    # 1. the new token, stored in the cache's dtype and read back from registers (never from memory) below
    new_k = tl.load(k_ptr + token * k_stride + h * dim + d, mask=d_ok, other=0.0)
    new_v = tl.load(v_ptr + token * v_stride + h * dim + d, mask=d_ok, other=0.0)
    new_k = new_k.to(key_cache_ptr.dtype.element_ty)
    new_v = new_v.to(value_cache_ptr.dtype.element_ty)
    free_block = tl.load(table_ptr + r * width + free // block_size).to(tl.int64)
    offset = free % block_size
    tl.store(key_cache_ptr + free_block * kc_block + offset * kc_token + h * kc_head + d, new_k, mask=d_ok)
    tl.store(value_cache_ptr + free_block * vc_block + offset * vc_token + h * vc_head + d, new_v, mask=d_ok)
    tl.store(pos_ptr + state + free, column)
    if not FUSED:
        tl.store(score_ptr + state + free, 0.0)
        tl.store(valid_ptr + state + free, 1)
    new_k = new_k.to(tl.float32)
    new_v = new_v.to(tl.float32)
    # 2. attention: pass 1, online softmax and the output
    q_at = token * q_stride + (h * group + g[:, None]) * dim + d[None, :]
    query = tl.load(q_ptr + q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(0, slots, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        # `blocks`: each slot's physical block, a vector; compiled Triton refuses a loop that rebinds a scalar
        logits, blocks = _logits(query, key_cache_ptr, table_ptr, pos_ptr, valid_ptr, r, h, n, d, d_ok, g_ok,
                                 slots, free, column, new_k, state, width, block_size, kc_block, kc_token,
                                 kc_head)  # fmt: skip
        peak = tl.maximum(m, tl.max(logits, 1))
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        p = tl.exp(logits - shift[:, None])
        alpha = tl.exp(m - shift)
        inside = n < slots
        at = (blocks * vc_block + (n % block_size) * vc_token + h * vc_head)[:, None] + d[None, :]
        values = tl.load(value_cache_ptr + at, mask=inside[:, None] & d_ok[None, :], other=0.0)
        values = tl.where((n == free)[:, None], new_v[None, :], values.to(tl.float32))
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], 1)
        total = total * alpha + tl.sum(p, 1)
        m = peak
    out = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * out_stride + (h * group + g[:, None]) * dim + d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
    shift = tl.where(m == float("-inf"), 0.0, m)
    # 3. pass 2: the mass, to `mass` or into the scores and the victim
    best = float("inf")
    victim = slots  # none yet
    end = slots if FUSED else mass_width
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < slots
        logits, _ = _logits(query, key_cache_ptr, table_ptr, pos_ptr, valid_ptr, r, h, n, d, d_ok, g_ok, slots,
                            free, column, new_k, state, width, block_size, kc_block, kc_token, kc_head)  # fmt: skip
        mass = tl.sum(tl.exp(logits - shift[:, None]) / total[:, None], 0)
        if FUSED:
            scores = tl.load(score_ptr + state + n, mask=inside, other=0.0)
            scores = tl.where(n == free, 0.0, scores) + mass
            tl.store(score_ptr + state + n, scores, mask=inside)
            pos = tl.where(n == free, column, tl.load(pos_ptr + state + n, mask=inside, other=0))
            candidate = tl.where(inside & (pos < recent_from) & (scores < float("inf")), scores, float("inf"))
            low = tl.min(candidate, 0)
            first = tl.min(tl.where(candidate == low, n, slots), 0)
            better = low < best
            victim = tl.where(better, first, victim)
            best = tl.where(better, low, best)
        else:
            tl.store(mass_ptr + (r * kv_heads + h) * mass_width + n, tl.where(inside, mass, 0.0), mask=n < mass_width)
    if FUSED:  # the victim defaults to slot 0 (no candidate), as the CPU kernel's scan; freed where the row evicts
        victim = tl.where(victim == slots, 0, victim)
        freed = evicts & (victim != free)
        tl.store(valid_ptr + state + free, tl.where(evicts & (victim == free), 0, 1).to(tl.int8))
        tl.store(valid_ptr + state + victim, 0, mask=freed)


@triton.jit
def _logits(query, key_cache_ptr, table_ptr, pos_ptr, valid_ptr, r, h, n, d, d_ok, g_ok, slots, free, column,
            new_k, state, width, block_size, kc_block, kc_token, kc_head):  # fmt: skip
    """Logits ``[BLOCK_G, BLOCK_N]`` over slots ``n`` (-inf where not visible) and the slots' physical blocks."""
    inside = n < slots
    block = tl.load(table_ptr + r * width + n // block_size, mask=inside, other=0).to(tl.int64)
    at = (block * kc_block + (n % block_size) * kc_token + h * kc_head)[:, None] + d[None, :]
    keys = tl.load(key_cache_ptr + at, mask=inside[:, None] & d_ok[None, :], other=0.0)
    is_new = n == free
    keys = tl.where(is_new[:, None], new_k[None, :], keys.to(tl.float32))
    pos = tl.where(is_new, column, tl.load(pos_ptr + state + n, mask=inside, other=0))
    valid = is_new | (tl.load(valid_ptr + state + n, mask=inside, other=0) != 0)
    visible = inside & valid & (pos <= column)
    logits = tl.sum(query[:, None, :] * keys[None, :, :], 2)
    return tl.where(visible[None, :] & g_ok[:, None], logits, float("-inf")), block


def paged_step(query, key, value, key_cache, value_cache, output, block_table, meta, pos, scores, valid, mass,
               scale: float) -> None:  # fmt: skip
    """One decode step of the rows of ``meta`` (see the module docstring), in place.

    ``query``/``output`` ``[tokens, H_q, D]``, ``key``/``value`` ``[tokens, H_kv, D]`` (heads contiguous),
    ``key_cache``/``value_cache`` ``[num_blocks, block_size, H_kv, D]`` (last axis contiguous), ``block_table`` int32
    ``[rows, width]``, ``pos``/``scores``/``valid`` int64/fp32/bool contiguous ``[requests, H_kv, state_width]``,
    ``mass`` fp32 ``[rows, H_kv, mass_width]`` or ``None`` (H2O: fold the mass into the scores and evict).
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("output", output)):
        if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"paged_step: {name} must be [tokens, heads, head_dim] with contiguous heads")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != 4 or t.stride(3) != 1 or t.shape != key_cache.shape:
            raise ValueError(f"paged_step: {name} must be [num_blocks, block_size, kv_heads, head_dim], last axis "
                             "contiguous")  # fmt: skip
    if block_table.dtype != torch.int32 or meta.dtype != torch.int64 or meta.shape[1:] != (META,):
        raise ValueError(f"paged_step: block_table must be int32 [rows, blocks] and meta int64 [rows, {META}]")
    if pos.dtype != torch.int64 or scores.dtype != torch.float32 or valid.dtype != torch.bool:
        raise ValueError("paged_step: pos/scores/valid must be int64/float32/bool [requests, kv_heads, width]")
    if not (pos.is_contiguous() and scores.is_contiguous() and valid.is_contiguous()):
        raise ValueError("paged_step: pos/scores/valid must be contiguous")
    rows, (_, block_size, kv_heads, dim) = meta.shape[0], key_cache.shape
    if rows == 0:
        return
    group = query.shape[1] // kv_heads
    mass_width = 0 if mass is None else mass.shape[-1]
    _paged_step[(rows, kv_heads)](
        query, key, value, key_cache, value_cache, output, block_table.contiguous(), meta.contiguous(), pos, scores,
        valid.view(torch.int8), scores if mass is None else mass, float(scale), query.stride(0), key.stride(0),
        value.stride(0), output.stride(0), *key_cache.stride()[:3], *value_cache.stride()[:3], block_table.shape[1],
        pos.shape[-1], mass_width, block_size, kv_heads, dim, group,
        FUSED=mass is None, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_G=triton.next_power_of_2(group),
    )  # fmt: skip
