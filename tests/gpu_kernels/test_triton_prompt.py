"""The prompt-mass kernel against its reference and against the transformers backend's own mass."""

from __future__ import annotations

import math

import pytest
import torch

from .interpreter import INTERPRET, require_triton

require_triton()

from h2o_kv.hf.attention import attention_with_mass  # noqa: E402
from h2o_kv.kernels.triton import prompt, reference  # noqa: E402


def _packed(device, dtype, q_lens, k_lens, kv_heads=2, group=2, dim=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu_q[-1]), kv_heads * group, dim, generator=g).to(dtype)
    key = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g).to(dtype)
    return query.to(device), key.to(device), cu_q.to(device), cu_k.to(device)


def _lse(query, key, cu_q, cu_k, scale):
    """Each query row's log-sum-exp over the keys it sees, as FlashAttention returns it ``[H_q, T_q]``."""
    group = query.shape[1] // key.shape[1]
    lse = torch.empty(query.shape[1], query.shape[0], device=query.device)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        logits = query[q0:q1].float().transpose(0, 1) @ key[k0:k1].float().permute(1, 2, 0).repeat_interleave(group, 0)
        visible = torch.arange(k1 - k0, device=query.device) <= torch.arange(q1 - q0, device=query.device)[:, None] + (
            k1 - k0 - (q1 - q0)
        )
        lse[:, q0:q1] = torch.logsumexp((logits * scale).masked_fill(~visible, -math.inf), -1)
    return lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_mass_matches_reference(device, dtype):
    """Whole prompts and later chunks (queries the last L_q of L_k keys), several key blocks, GQA."""
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("bf16 tl.dot: on CUDA only (the interpreter has none; fp32 covers the same code)")
    query, key, cu_q, cu_k = _packed(device, dtype, [40, 7, 33], [40, 50, 70])
    lse = _lse(query, key, cu_q, cu_k, 0.4)
    mass = prompt.prompt_mass(query, key, lse, cu_q, cu_k, 0.4)
    expected = reference.prompt_mass(query, key, lse, cu_q, cu_k, 0.4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mass, expected, atol=tol, rtol=tol)
    assert abs(float(mass.sum()) - query.shape[0] * query.shape[1]) < 1e-3 * query.numel()  # rows sum to 1


def test_prompt_mass_is_the_transformers_backends_mass(device):
    """One sequence: the same per-key mass as :func:`h2o_kv.hf.attention.attention_with_mass` computes."""
    query, key, cu_q, cu_k = _packed(device, torch.float32, [45], [45], kv_heads=2, group=3, dim=16, seed=1)
    mass = prompt.prompt_mass(query, key, _lse(query, key, cu_q, cu_k, 0.25), cu_q, cu_k, 0.25)
    q, k = query.transpose(0, 1)[None], key.transpose(0, 1)[None]
    pos = torch.arange(45, device=device).expand(1, 2, 45)
    _, expected, _ = attention_with_mass(q, k, k, pos, None, 0, 0.25, chunk_start=0)
    torch.testing.assert_close(mass, expected[0], atol=1e-5, rtol=1e-5)
