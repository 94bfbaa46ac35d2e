"""The vLLM backend's fused prompt-chunk kernel (``paged_prefill``) against its torch reference (``prefill_torch``, the
transformers backend's ``attention_with_mass`` over the gathered keys): outputs, the mass of every key and that of the
observation window, on random paged caches (several blocks, GQA, chunks after earlier chunks)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'h2o-kv[vllm]', see docs/vllm.md)", allow_module_level=True)

import torch

from h2o_kv import kernels
from h2o_kv.hf.attention import attention_with_mass
from h2o_kv.policies import make_policy
from h2o_kv.vllm.attention import LayerEntries, PagedCache, RequestEntries, Row, _prefill_batch, prefill_torch

KV_HEADS, GROUP, BLOCKS = 2, 3, 48
pytestmark = pytest.mark.skipif(
    kernels.prefill_ops() is None, reason="no C++ compiler: prompt chunks fall back to prefill_torch"
)


def _setup(generator, chunks, dim: int, block: int):
    """``chunks``: (prompt, column, queries, window) per row; one batch of them plus a token of another request."""
    rows, used = [], 0
    blocks = torch.randperm(BLOCKS - 1, generator=generator) + 1
    start = 0
    for prompt, column, queries, window in chunks:
        entries = RequestEntries(make_policy("snapkv", 4, 4, window=window), prompt=prompt, new_tokens=8)
        slots = column + queries
        count = -(-prompt // block)
        window_from = max(0, prompt - window - column)
        rows.append(Row(entries, start, queries, column, slots, blocks[used : used + count], True, False, window_from))
        used, start = used + count, start + queries
    tokens = start + 1
    qkv = torch.randn((tokens, KV_HEADS * (GROUP + 2) * dim), generator=generator)  # vLLM's query is a view
    query = qkv[:, : KV_HEADS * GROUP * dim].view(tokens, KV_HEADS * GROUP, dim) * 3  # peaky attention
    kv_cache = torch.randn((BLOCKS, KV_HEADS, block, 2 * dim), generator=generator)
    return rows, query, kv_cache


def _layers(rows):
    """Each row's layer state with random sums of earlier chunks (the kernel adds to them)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(KV_HEADS, row.entries.prompt) for row in rows]
    return [LayerEntries(None, None, None, torch.rand(s, generator=generator), torch.rand(s, generator=generator))
            for s in shapes]  # fmt: skip


def _kernel(rows, layers, query, kv_cache, dim):
    output = torch.zeros((query.shape[0], KV_HEADS * GROUP * dim))
    batch = _prefill_batch(tuple(rows))
    kernels.prefill_ops().paged_prefill(
        query, kv_cache, output.view(query.shape[0], KV_HEADS * GROUP, dim), batch.block_table, batch.meta,
        [x.prompt_mass for x in layers], [x.window_mass for x in layers], dim**-0.5,
    )  # fmt: skip
    return output


@pytest.mark.parametrize("dim, block", [(32, 16), (64, 32)])
@pytest.mark.parametrize(
    "chunks",
    [
        [(40, 0, 40, 8)],  # one whole prompt
        [(200, 128, 72, 32), (90, 0, 50, 16), (33, 17, 16, 40)],  # later chunks, window in this chunk or before
        [(300, 64, 1, 4), (150, 100, 50, 8), (75, 0, 75, 100)],  # a one-query chunk; a window over the whole prompt
    ],
    ids=["one", "later_chunks", "edges"],
)
def test_kernel_equals_torch_reference(chunks, dim, block):
    generator = torch.Generator().manual_seed(dim + len(chunks))
    rows, query, kv_cache = _setup(generator, chunks, dim, block)
    layers_k, layers_t = _layers(rows), _layers(rows)
    out_k = _kernel(rows, layers_k, query, kv_cache, dim)
    out_t = torch.zeros_like(out_k)
    for row, layer in zip(rows, layers_t, strict=True):
        prefill_torch(row, layer, query, PagedCache(kv_cache.clone()), out_t, dim**-0.5)
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
    assert out_k[-1].abs().sum() == 0  # the other request's token is not touched
    for k, t in zip(layers_k, layers_t, strict=True):
        torch.testing.assert_close(k.prompt_mass, t.prompt_mass, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k.window_mass, t.window_mass, rtol=1e-5, atol=1e-5)
    for row, before, after in zip(rows, _layers(rows), layers_k, strict=True):  # each query head's row sums to 1
        added = (after.prompt_mass - before.prompt_mass).sum(-1)
        torch.testing.assert_close(added, torch.full((KV_HEADS,), float(row.queries * GROUP)))


def test_chunks_add_up_to_the_whole_prompt():
    """A prompt in three chunks (the window spanning the last two) gets the mass and the window mass that one
    attention over the whole prompt gives (the transformers backend's single prompt chunk)."""
    prompt, window, dim, block = 97, 30, 32, 16
    generator = torch.Generator().manual_seed(5)
    starts = (0, 60, 80)
    chunks = [(prompt, s, e - s, window) for s, e in zip(starts, (*starts[1:], prompt), strict=True)]
    rows, query, kv_cache = _setup(generator, chunks, dim, block)
    rows = [replace(row, blocks=rows[0].blocks) for row in rows]  # one request: the same blocks
    shape = (KV_HEADS, prompt)
    layer = LayerEntries(None, None, None, torch.zeros(shape), torch.zeros(shape))
    for row in rows:  # one step per chunk
        _kernel([row], [layer], query, kv_cache, dim)
    keys, values = PagedCache(kv_cache).read(rows[0].blocks, prompt)
    whole = query[:prompt].transpose(0, 1).unsqueeze(0)
    pos = torch.arange(prompt).expand(1, KV_HEADS, -1)
    _, mass, last = attention_with_mass(
        whole, keys[None], values[None], pos, None, 0, dim**-0.5, window=window, chunk_start=0
    )
    torch.testing.assert_close(layer.prompt_mass, mass[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.window_mass, last[0], rtol=1e-5, atol=1e-5)
    assert [row.window_from for row in rows] == [67, 7, 0]  # the window's first query is in the second chunk
