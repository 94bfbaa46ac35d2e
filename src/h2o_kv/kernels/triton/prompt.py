"""The probability mass each prompt key receives, from the attention's log-sum-exp, without an ``L x L`` matrix.

H2O (Zhang et al., arXiv:2306.14048) scores a prompt key by the post-softmax probability it receives from every
query that sees it, summed over the query heads of its KV group. FlashAttention-style kernels never materialise
those probabilities but can return each query row's log-sum-exp ``lse = log sum_j exp(q.k_j * scale)`` (natural
log); then ``p_ij = exp(q_i.k_j * scale - lse_i)`` is one dot product away, and the column sums need one more read
of Q and K: the backend keeps its own fast attention for the output. Sequences are packed as vLLM packs them
(``cu_seqlens``); a sequence's queries are its last ``L_q`` of ``L_k`` tokens (chunked prefill), so query ``i``
sees key ``j`` when ``j <= L_k - L_q + i``. One program per (key block, KV head, sequence) walks only the query
blocks that can see its keys and owns its outputs (no atomics). Reference:
:func:`h2o_kv.kernels.triton.reference.prompt_mass`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32  # queries per iteration
BLOCK_N = 32  # keys per program


@triton.jit
def _prompt_mass(
    q_ptr, k_ptr, lse_ptr, mass_ptr, cu_q_ptr, cu_k_ptr, scale, q_stride, k_stride, lse_stride, mass_stride,
    dim, group, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1) - q0
    k0 = tl.load(cu_k_ptr + b).to(tl.int64)
    k_len = tl.load(cu_k_ptr + b + 1) - k0
    before = k_len - q_len  # keys before the first query (earlier chunks)
    j = block * BLOCK_N + tl.arange(0, BLOCK_N)
    if block * BLOCK_N < k_len:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        keys = tl.load(k_ptr + (k0 + j[:, None]) * k_stride + h * dim + d[None, :],
                       mask=(j < k_len)[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        mass = tl.zeros((BLOCK_N,), tl.float32)
        first = tl.maximum(block * BLOCK_N - before, 0) // BLOCK_M * BLOCK_M  # the first query that sees a key here
        for g in range(group):
            head = h * group + g
            for start in range(first, q_len, BLOCK_M):
                i = start + tl.arange(0, BLOCK_M)
                rows = tl.load(q_ptr + (q0 + i[:, None]) * q_stride + head * dim + d[None, :],
                               mask=(i < q_len)[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
                lse = tl.load(lse_ptr + head * lse_stride + q0 + i, mask=i < q_len, other=0.0)
                if IEEE:
                    logits = tl.dot(rows, tl.trans(keys), input_precision="ieee")
                else:
                    logits = tl.dot(rows, tl.trans(keys))
                visible = (i < q_len)[:, None] & (j[None, :] <= before + i[:, None]) & (j < k_len)[None, :]
                p = tl.exp(logits * scale - lse[:, None])
                mass += tl.sum(tl.where(visible, p, 0.0), 0)
        tl.store(mass_ptr + h * mass_stride + k0 + j, mass, mask=j < k_len)


def prompt_mass(query, key, lse, cu_seqlens_q, cu_seqlens_k, scale: float) -> torch.Tensor:
    """Per KV head, the probability each key received from the queries of its sequence, summed over the group.

    ``query [T_q, H_q, D]``, ``key [T_k, H_kv, D]`` (heads contiguous; fp32, fp16 or bf16), ``lse [H_q, T_q]`` fp32
    (FlashAttention's varlen ``softmax_lse``, natural log), ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B + 1]``.
    Returns ``mass [H_kv, T_k]`` fp32.
    """
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"prompt_mass: {name} must be [tokens, heads, head_dim] with contiguous heads")
    if lse.dtype != torch.float32 or lse.shape != (query.shape[1], query.shape[0]) or lse.stride(1) != 1:
        raise ValueError("prompt_mass: lse must be float32 [query_heads, tokens] with contiguous tokens")
    kv_heads, dim = key.shape[1], key.shape[2]
    mass = torch.zeros((kv_heads, key.shape[0]), dtype=torch.float32, device=key.device)
    longest = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    grid = (triton.cdiv(longest, BLOCK_N), kv_heads, cu_seqlens_k.numel() - 1)
    _prompt_mass[grid](
        query, key, lse, mass, cu_seqlens_q, cu_seqlens_k, float(scale), query.stride(0), key.stride(0),
        lse.stride(0), mass.stride(0), dim, query.shape[1] // kv_heads, IEEE=query.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return mass
