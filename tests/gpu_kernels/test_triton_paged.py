"""The paged decode kernel (vLLM's GPU cache layout) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from .interpreter import require_triton

require_triton()

from h2o_kv.kernels.triton import paged, reference  # noqa: E402

KV_HEADS, GROUP, DIM, BLOCK, BLOCKS, WIDTH = 2, 2, 12, 8, 24, 40


LAYOUTS = {  # one layer's cache tensor -> its key and value caches [num_blocks, block_size, kv_heads, head_dim]
    "vllm-0.32": ((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), lambda kv: kv.transpose(1, 2).split(DIM, dim=-1)),
    "2-planes": ((2, BLOCKS, BLOCK, KV_HEADS, DIM), lambda kv: kv.unbind(0)),
}


def _batch(device, dtype, fused: bool, layout: str, seed=0):
    """Three rows (one without eviction) over shuffled blocks; each head has one free slot somewhere."""
    g = torch.Generator().manual_seed(seed)
    tokens = 5
    query = torch.randn(tokens, KV_HEADS * GROUP, DIM, generator=g).to(dtype)
    key, value = (torch.randn(tokens, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(LAYOUTS[layout][0], generator=g).to(dtype)
    # disjoint blocks, as vLLM gives requests (no prefix caching): a block shared by two rows is a race on a GPU,
    # where the rows' programs run at once (the interpreter runs them one after another)
    table = torch.randperm(BLOCKS, generator=g)[:20].view(4, 5).int()
    # token, slots, column, evicts, recent from, state row (rows use the pools out of order); the last row pads
    meta = torch.tensor([[3, 25, 100, 1, 90, 2], [0, 9, 50, 0, 40, 0], [4, 40, 70, 1, 60, 1], [0, 0, 0, 0, 0, 0]])
    pos = torch.stack([torch.randperm(100, generator=g)[:WIDTH] for _ in range(3 * KV_HEADS)]).view(3, KV_HEADS, -1)
    scores = torch.rand(3, KV_HEADS, WIDTH, generator=g)
    valid = torch.zeros(3, KV_HEADS, WIDTH, dtype=torch.bool)
    for _, slots, _, _, _, state in meta[:3].tolist():
        valid[state, :, :slots] = True
        valid[state, torch.arange(KV_HEADS), torch.randint(0, slots, (KV_HEADS,), generator=g)] = False
    mass = None if fused else torch.full((4, KV_HEADS, 48), 7.0)  # stale values past a row's slots are zeroed
    output = torch.zeros(tokens, KV_HEADS * GROUP, DIM, dtype=dtype)
    args = (query, key, value, cache, output, table, meta, pos, scores, valid, mass)
    return [None if t is None else t.to(device) for t in args]


NAMES = ("query", "key", "value", "kv_cache", "output", "block_table", "meta", "pos", "scores", "valid", "mass")


def _step(step, args, layout):
    cache = args[3]
    step(*args[:3], *LAYOUTS[layout][1](cache), *args[4:], 0.3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False], ids=["h2o", "mass"])
def test_paged_step_matches_reference(device, dtype, fused, layout):
    """Write into each head's first free slot, attention, mass or H2O's update and freed victim, per row."""
    mine = _batch(device, dtype, fused, layout)
    theirs = [None if t is None else t.clone() for t in mine]
    _step(paged.paged_step, mine, layout)
    _step(reference.paged_step, theirs, layout)
    # the output is rounded to the cache dtype (the interpreter truncates bf16, a GPU rounds: one ulp apart)
    out_tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    for name, a, b in zip(NAMES, mine, theirs, strict=True):
        if a is None:
            continue
        tol = out_tol if name == "output" else 1e-5
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")
    if not fused:
        assert bool((mine[NAMES.index("mass")][3] == 7.0).all())  # the padding row wrote nothing
    valid = mine[NAMES.index("valid")]
    if fused:  # rows 0 and 2 evicted one entry each (after taking the free slot): exactly one free slot per head
        assert (~valid[2, :, :25]).sum(-1).tolist() == [1, 1] and (~valid[1, :, :40]).sum(-1).tolist() == [1, 1]
        assert bool(valid[0, :, :9].all())  # the row that does not evict filled its free slot
    else:
        assert bool(valid[0, :, :9].all()) and bool(valid[2, :, :25].all())


def test_paged_step_refuses_a_bad_layout(device):
    args = _batch(device, torch.float32, True, "2-planes")
    keys, values = args[3].unbind(0)
    with pytest.raises(ValueError, match="key_cache must be .num_blocks, block_size, kv_heads, head_dim"):
        paged.paged_step(*args[:3], keys.transpose(2, 3), values, *args[4:], 0.3)
