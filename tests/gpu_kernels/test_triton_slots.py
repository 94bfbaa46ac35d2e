"""The slot-layout decode kernels against their torch references (and the CPU kernels' contract)."""

from __future__ import annotations

import pytest
import torch

from .interpreter import INTERPRET, interpreted, require_triton

require_triton()

from h2o_kv.kernels.triton import reference, slots  # noqa: E402


def test_kernels_run_where_the_conftest_says():
    assert interpreted(slots._slot_step) == INTERPRET


def _state(device, batch, kv_heads, n, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, n, dim, generator=g).to(dtype)
    values = torch.randn(batch, kv_heads, n, dim, generator=g).to(dtype)
    pos = torch.stack([torch.randperm(3 * n, generator=g)[:n] for _ in range(batch * kv_heads)])
    pos = pos.view(batch, kv_heads, n)
    scores = torch.rand(batch, kv_heads, n, generator=g)
    valid = torch.rand(batch, kv_heads, n, generator=g) > 0.2
    free = torch.randint(0, n, (batch, kv_heads, 1), generator=g)
    return [t.to(device) for t in (keys, values, pos, scores, valid, free)]


def _assert_same(kernel_state, reference_state, atol):
    for name, a, b in zip(("keys", "values", "pos", "scores", "valid"), kernel_state, reference_state, strict=False):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=lambda m, name=name: f"{name}: {m}")


SHAPES = [(2, 2, 2, 70, 12), (1, 1, 1, 5, 16), (1, 2, 4, 130, 8)]  # batch, kv heads, group, slots, head dim


@pytest.mark.parametrize(("batch", "kv_heads", "group", "n", "dim"), SHAPES)
@pytest.mark.parametrize("h2o", [True, False], ids=["h2o", "mass"])
def test_slot_step_matches_reference(device, batch, kv_heads, group, n, dim, h2o):
    """Write, attention over the visible slots, mass over the group, and (H2O) the score update and victim."""
    state = _state(device, batch, kv_heads, n, dim, torch.float32)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=g).to(device)
    key, value = (torch.randn(batch, kv_heads, 1, dim, generator=g).to(device) for _ in range(2))
    column, recent_from = 3 * n, 2 * n if h2o else None
    mine, theirs = [t.clone() for t in state], [t.clone() for t in state]
    out, mass, victim = slots.slot_step(query, *mine, key, value, column, 0.3, recent_from)
    ref_out, ref_mass, ref_victim = reference.slot_step(query, *theirs, key, value, column, 0.3, recent_from)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_same(mine, theirs, 1e-5)
    if h2o:
        assert mass is None and torch.equal(victim, ref_victim)
    else:
        assert victim is None
        torch.testing.assert_close(mass, ref_mass, atol=1e-6, rtol=1e-5)
        assert torch.allclose(mass.sum(-1), torch.full_like(mass[..., 0], group))  # each query head's row sums to 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_slot_is_the_cpu_kernels_write(device, dtype):
    state = _state(device, 2, 3, 40, 24, dtype)
    g = torch.Generator().manual_seed(2)
    key, value = (torch.randn(2, 3, 1, 24, generator=g).to(dtype).to(device) for _ in range(2))
    mine, theirs = [t.clone() for t in state], [t.clone() for t in state]
    slots.write_slot(*mine, key, value, 999)
    keys, values, pos, scores, valid, free = theirs
    keys.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, 24), key)
    values.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, 24), value)
    pos.scatter_(2, free, 999)
    scores.scatter_(2, free, 0.0)
    valid.scatter_(2, free, True)
    _assert_same(mine, theirs, 0.0)


def test_h2o_victim_takes_the_first_lowest_outside_the_recent_window(device):
    """Ties (integer scores) go to the first slot; the recent window, NaN and +inf are never the victim: the CPU
    kernel's contract (``decode_step.cpp``), which ``tests/test_kernels.py`` checks against the same torch ops."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (3, 2, 150), generator=g).float()
    scores[0, 0, :10] = float("nan")
    scores[0, 1, 5] = float("-inf")
    scores[1, 0, :] = float("inf")  # no candidate: slot 0, as the CPU kernel
    pos = torch.stack([torch.randperm(200, generator=g)[:150] for _ in range(6)]).view(3, 2, 150)
    mass = torch.randint(0, 2, (3, 2, 150), generator=g).float()
    mine, theirs = scores.clone().to(device), scores.clone().to(device)
    victim = slots.h2o_victim(mine, mass.to(device), pos.to(device), 120)
    reference.h2o_victim(theirs, mass.to(device), pos.to(device), 120)  # the in-place update
    finite = torch.nan_to_num(theirs, nan=float("inf"))  # torch.min would pick a NaN; the kernels never do
    expected = finite.masked_fill(pos.to(device) >= 120, float("inf")).min(-1, keepdim=True).indices
    expected[1, 0] = 0  # torch.min's index among equal values is unspecified
    assert torch.equal(victim, expected)
    torch.testing.assert_close(mine, theirs, equal_nan=True, atol=0, rtol=0)
