"""The torch references of the Triton kernels (:mod:`h2o_kv.kernels.triton`): plain, slow, obviously right.

Each takes the kernel's arguments and returns (or updates in place) what the kernel does, with dense fp32
arithmetic; the tests compare the two.
"""

from __future__ import annotations

import math

import torch


def slot_step(query, keys, values, pos, scores, valid, free, key, value, column: int, scale: float,
              recent_from: int | None = None):  # fmt: skip
    """:func:`h2o_kv.kernels.triton.slots.slot_step` as torch ops (same in-place updates, same returns)."""
    keys.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]), key)
    values.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]), value)
    pos.scatter_(2, free, column)
    scores.scatter_(2, free, 0.0)
    valid.scatter_(2, free, True)
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    q = query.float().view(batch, kv_heads, group, dim)
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys.float()) * scale
    visible = (valid & (pos <= column))[:, :, None, :]
    probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
    output = torch.einsum("bhgn,bhnd->bhgd", probs, values.float()).to(query.dtype)
    output = output.reshape(batch, 1, q_heads, dim)
    mass = probs.sum(2)
    if recent_from is None:
        return output, mass, None
    return output, None, h2o_victim(scores, mass, pos, recent_from)


def h2o_victim(scores, mass, pos, recent_from: int) -> torch.Tensor:
    """``scores += mass``; the first slot of lowest score whose column is below ``recent_from``, per row."""
    scores.add_(mass)
    return scores.masked_fill(pos >= recent_from, math.inf).min(-1, keepdim=True).indices


def paged_step(query, key, value, key_cache, value_cache, output, block_table, meta, pos, scores, valid, mass,
               scale: float):  # fmt: skip
    """:func:`h2o_kv.kernels.triton.paged.paged_step` as torch ops, row by row (same in-place updates)."""
    block_size = key_cache.shape[1]
    for r in range(meta.shape[0]):
        token, slots, column, evicts, recent_from, state = (int(x) for x in meta[r])
        if slots == 0:  # a padding row
            continue
        blocks = block_table[r, : (slots + block_size - 1) // block_size].long()
        heads = torch.arange(key.shape[1])
        p, s, ok = pos[state, :, :slots], scores[state, :, :slots], valid[state, :, :slots]
        free = ok.byte().argmin(-1)  # [kv_heads]: each head's first free slot
        key_cache[blocks[free // block_size], free % block_size, heads] = key[token].to(key_cache.dtype)
        value_cache[blocks[free // block_size], free % block_size, heads] = value[token].to(value_cache.dtype)
        p[heads, free], s[heads, free], ok[heads, free] = column, 0.0, True
        k = key_cache[blocks].flatten(0, 1)[:slots].transpose(0, 1).float()  # [kv_heads, slots, head_dim]
        v = value_cache[blocks].flatten(0, 1)[:slots].transpose(0, 1).float()
        kv_heads, dim = k.shape[0], k.shape[-1]
        q = query[token].float().view(kv_heads, -1, dim)
        logits = torch.einsum("hgd,hnd->hgn", q, k) * scale
        probs = torch.softmax(logits.masked_fill(~(ok & (p <= column))[:, None], -math.inf), dim=-1)
        output[token] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(output[token].shape).to(output.dtype)
        step_mass = probs.sum(1)
        if mass is not None:
            mass[r].zero_()
            mass[r, :, :slots] = step_mass
            continue
        s += step_mass
        if evicts:
            victim = s.masked_fill(p >= recent_from, math.inf).min(-1).indices
            ok[heads, victim] = False


def prompt_mass(query, key, lse, cu_seqlens_q, cu_seqlens_k, scale: float) -> torch.Tensor:
    """:func:`h2o_kv.kernels.triton.prompt.prompt_mass` with explicit ``[L_q, L_k]`` probabilities per sequence."""
    kv_heads = key.shape[1]
    mass = torch.zeros((kv_heads, key.shape[0]), dtype=torch.float32, device=key.device)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        q = query[q0:q1].float().transpose(0, 1)  # [H_q, L_q, D]
        k = key[k0:k1].float().transpose(0, 1).repeat_interleave(query.shape[1] // kv_heads, 0)
        logits = q @ k.transpose(1, 2) * scale
        rows, cols = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
        visible = cols <= rows + (k1 - k0) - (q1 - q0)  # the queries are the sequence's last L_q tokens
        probs = torch.exp(logits - lse[:, q0:q1, None].float()).masked_fill(~visible.to(key.device), 0.0)
        mass[:, k0:k1] = probs.view(kv_heads, -1, k1 - k0).sum(1)
    return mass
