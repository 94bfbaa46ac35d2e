"""The vLLM backend's fused decode kernel (``paged_decode``) against its torch reference (``decode_torch``): the same
slots written, outputs and scores within fp32 rounding, the same victims, on random paged caches."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]', see docs/vllm.md)", allow_module_level=True)

import torch

from h2o_kv import kernels
from h2o_kv.policies import make_policy
from h2o_kv.vllm.attention import (
    DecodeBatch,
    LayerEntries,
    PagedCache,
    RequestEntries,
    Row,
    _decode_batch,
    decode_torch,
    rank,
)

# every test runs the compiled kernel: without a C++ compiler they skip (the backend then runs decode_torch)
pytestmark = pytest.mark.skipif(
    kernels.paged_ops() is None, reason="no C++ compiler: the kernel falls back to decode_torch"
)

BLOCK, KV_HEADS, GROUP, DIM, BLOCKS = 16, 2, 3, 32, 40


def _rows(generator, policy_name: str, slots: list[int], full: list[bool]):
    """Rows of a decode step with their layer state: each row's slots but one valid (scores random), the free one
    where the previous step evicted; ``full``: the row is over capacity (it evicts), else it grows by one slot."""
    rows, layers, blocks = [], [], torch.randperm(BLOCKS - 1, generator=generator) + 1
    used = 0
    for i, (n, evicting) in enumerate(zip(slots, full, strict=True)):
        capacity = n - 1 if evicting else n + 4
        policy = make_policy(policy_name, capacity - capacity // 2, capacity // 2)
        column = 3 * n + i  # columns past the slots: some were evicted before
        pos = torch.full((KV_HEADS, n + 2), -1, dtype=torch.long)
        valid = torch.zeros((KV_HEADS, n + 2), dtype=torch.bool)
        for h in range(KV_HEADS):
            pos[h, :n] = torch.randperm(column, generator=generator)[:n].sort().values
            free = int(torch.randint(0, n, (1,), generator=generator))
            valid[h, :n] = True
            valid[h, free] = False
        scores = torch.rand((KV_HEADS, n + 2), generator=generator) * valid
        layers.append(LayerEntries(pos, scores, valid))
        count = -(-n // BLOCK)
        entries = RequestEntries(policy, prompt=column, new_tokens=64, slots=n)
        rows.append(Row(entries, i, 1, column, n, blocks[used : used + count], False, False))
        used += count
    return rows, layers


def _step(policy_name, slots, full, fused: bool):
    generator = torch.Generator().manual_seed(len(slots) * 7 + sum(slots))
    rows, layers = _rows(generator, policy_name, slots, full)
    tokens = len(rows) + 1  # one extra token (a row of another request)
    query = torch.randn((tokens, KV_HEADS * GROUP, DIM), generator=generator)
    qkv = torch.randn((tokens, KV_HEADS * (GROUP + 2) * DIM), generator=generator)  # vLLM's q/k/v are views
    key = qkv[:, : KV_HEADS * DIM].view(tokens, KV_HEADS, DIM)
    value = qkv[:, KV_HEADS * DIM : 2 * KV_HEADS * DIM].view(tokens, KV_HEADS, DIM)
    kv_cache = torch.randn((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), generator=generator)
    states = {}
    for name in ("kernel", "torch"):
        cache_copy = kv_cache.clone()
        layer_copies = [LayerEntries(x.pos.clone(), x.scores.clone(), x.valid.clone()) for x in layers]
        output = torch.zeros((tokens, KV_HEADS * GROUP * DIM))
        cache = PagedCache(cache_copy)
        if name == "torch":
            for row, layer in zip(rows, layer_copies, strict=True):
                decode_torch(row, layer, query, key, value, cache, output, DIM**-0.5)
        else:
            batch: DecodeBatch = _decode_batch(tuple(rows))
            mass = None if fused else torch.empty((len(rows), KV_HEADS, max(slots)))
            kernels.paged_ops().paged_decode(
                query, key, value, cache_copy, output.view(tokens, KV_HEADS * GROUP, DIM), batch.block_table,
                batch.meta, [x.pos for x in layer_copies], [x.scores for x in layer_copies],
                [x.valid for x in layer_copies], mass, DIM**-0.5,
            )  # fmt: skip
            if not fused:
                for j, (row, layer) in enumerate(zip(rows, layer_copies, strict=True)):
                    rank(row, layer, mass[j : j + 1, :, : row.slots], cache)
        states[name] = (cache_copy, layer_copies, output)
    return states


@pytest.mark.parametrize("policy_name, fused", [("h2o", True), ("h2o", False), ("tova", False), ("keydiff", False)])
@pytest.mark.parametrize(
    "slots, full", [([5, 16, 17, 40], [True, True, False, True]), ([33], [False]), ([1, 48], [False, True])]
)
def test_kernel_equals_torch_reference(policy_name, fused, slots, full):
    states = _step(policy_name, slots, full, fused)
    (cache_k, layers_k, out_k), (cache_t, layers_t, out_t) = states["kernel"], states["torch"]
    assert torch.equal(cache_k, cache_t)  # the same slots written, nothing else touched
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-6)
    for k, t in zip(layers_k, layers_t, strict=True):
        assert torch.equal(k.pos, t.pos)
        assert torch.equal(k.valid, t.valid)  # the same victims
        torch.testing.assert_close(k.scores, t.scores, rtol=1e-5, atol=1e-6)
    assert out_k[len(slots)].abs().sum() == 0  # the other request's row is not touched


def test_rows_that_evict_free_exactly_one_slot_per_head():
    states = _step("h2o", [20, 9], [True, False], fused=True)
    _, layers, _ = states["kernel"]
    assert layers[0].valid[:, :20].sum(-1).tolist() == [19] * KV_HEADS  # wrote one, freed one
    assert layers[1].valid[:, :9].sum(-1).tolist() == [9] * KV_HEADS  # grew into its free slot
