"""Per-head packed storage (``h2o_kv.hf.packed``): the same outputs as the padded layout, bit for bit, in the bytes
of the entries kept."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt

from h2o_kv import H2OCache, load_model
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.hf.packed import PackedSlots
from h2o_kv.hf.reconstruct import Reconstruction, prefill


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def kept_sets(cache: H2OCache) -> list:
    return [
        [set(lay.pos[b, h][lay.valid[b, h]].tolist()) for b in range(lay.pos.shape[0]) for h in range(lay.pos.shape[1])]
        for lay in cache.layers
    ]


def segment_bytes(cache: H2OCache) -> int:
    """Bytes of keys and values a packed cache should allocate: each head's entries plus its free slot."""
    total = 0
    for lay in cache.layers:
        entry = lay.keys.shape[-1] * lay.keys.dtype.itemsize * 2
        total += int(lay.keys.sizes.sum()) * entry
        assert bool((lay.keys.sizes >= lay.entry_count()).all())
        assert int(lay.keys.sizes.sum()) <= int(lay.entry_count().sum()) + lay.keys.sizes.numel()
    return total


def test_packed_slots_round_trip_write_and_grow():
    padded = torch.randn(2, 3, 5, 4)
    sizes = torch.tensor([[5, 2, 3], [1, 4, 0]])
    packed = PackedSlots.pack(padded, sizes)
    assert packed.data.shape == (15, 4) and packed.shape == padded.shape and packed.nbytes() == 15 * 4 * 4
    mask = torch.arange(5) < sizes.unsqueeze(-1)
    assert torch.equal(packed.read(), padded * mask.unsqueeze(-1))
    new = torch.randn(2, 3, 1, 4)
    slot = torch.tensor([[[4], [1], [2]], [[0], [3], [0]]])
    sizes_ok = sizes.clone()
    sizes_ok[1, 2] = 1  # a head with no segment cannot be written: give it one slot
    packed = PackedSlots.pack(padded, sizes_ok)
    packed.write(slot, new)
    out = packed.read()
    for b in range(2):
        for h in range(3):
            assert torch.equal(out[b, h, slot[b, h, 0]], new[b, h, 0])
    grown = packed.grown(sizes_ok + 2, int((sizes_ok + 2).max()))
    assert grown.shape[2] == 7 and torch.equal(grown.read()[:, :, :5], out)
    assert torch.equal(grown.index_select(0, torch.tensor([1])).read(), grown.read()[1:])
    with pytest.raises(ValueError, match="sizes must be at most the 5 slots"):
        PackedSlots.pack(padded, sizes + 1)


@pytest.mark.parametrize(
    "policy, options",
    [
        ("ada_h2o", {}),
        ("ada_window_h2o", {}),
        ("global_h2o", {}),
        ("global_window_h2o", {"recent_share": 0.1}),
        ("global_window_h2o", {"decode": "grow"}),
        ("global_snapkv", {}),
    ],
    ids=["ada_h2o", "ada_window_h2o", "global_h2o", "global_window_h2o", "global_window_h2o_grow", "global_snapkv"],
)
def test_packed_equals_padded_in_fewer_bytes(llama, policy, options):
    """Tokens, logits (bit for bit) and every head's kept columns equal the padded layout's through 12 decode
    steps of a batch of two prompts (one left-padded); the packed keys and values hold exactly each head's
    segment, fewer bytes than the padded buffer whenever heads' counts differ."""
    ids = random_prompt(56, seed=8, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    runs = {}
    for packed in (True, False):
        cache = H2OCache(heavy=6, recent=6, policy=policy, packed=packed, **options)
        tokens, logits = greedy_generate(llama, ids, cache, 12, attention_mask=mask)
        runs[packed] = (tokens, logits, kept_sets(cache), cache)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    assert runs[True][2] == runs[False][2]
    packed_cache, padded_cache = runs[True][3], runs[False][3]
    assert all(isinstance(lay.keys, PackedSlots) and isinstance(lay.values, PackedSlots) for lay in packed_cache.layers)
    assert packed_cache.stats()["kv_bytes"] == segment_bytes(packed_cache)
    counts = torch.stack([lay.entry_count() for lay in padded_cache.layers])
    if bool((counts != counts.flatten()[0]).any()):
        assert packed_cache.stats()["kv_bytes"] < padded_cache.stats()["kv_bytes"]


def test_packed_reconstruction_prefill_and_multi_turn(llama):
    """The winner's path: a reconstruction-scored prompt, decode steps, then a second prompt chunk (a chat turn)
    that reads the packed entries back; equal to the padded layout throughout."""
    ids = random_prompt(60, seed=11)
    turn = random_prompt(7, seed=12)
    reconstruction = Reconstruction(request=random_prompt(5, seed=99)[0].tolist(), prefix=[])
    outs = {}
    for packed in (True, False):
        cache = H2OCache(heavy=8, recent=8, policy="global_window_h2o", packed=packed)
        with torch.no_grad():
            logits = [prefill(llama, cache, ids, reconstruction)]
            cache.select_across_layers()
            for token in random_prompt(5, seed=13)[0]:
                logits.append(llama(token.view(1, 1), **cache_kwargs(cache), use_cache=True).logits[:, -1])
            logits.append(llama(turn, **cache_kwargs(cache), use_cache=True).logits[:, -1])
            cache.select_across_layers()
            logits.append(llama(turn[:, :1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
        outs[packed] = (torch.stack(logits), kept_sets(cache), cache.stats()["kv_bytes"])
    assert torch.equal(outs[True][0], outs[False][0]) and outs[True][1] == outs[False][1]
    assert outs[True][2] < outs[False][2]


def test_packed_batch_copies_and_reorders_equal_padded(llama):
    """``batch_repeat_interleave`` (one row per answer choice) and ``batch_select_indices`` (beam search) on packed
    segments give the padded layout's logits."""
    ids, later = random_prompt(40, seed=3), random_prompt(5, seed=4).expand(3, -1)
    outs = {}
    for packed in (True, False):
        cache = H2OCache(heavy=5, recent=5, policy="global_window_h2o", packed=packed)
        with torch.no_grad():
            llama(ids, **cache_kwargs(cache), use_cache=True)
            cache.select_across_layers()
            cache.stepwise = True
            llama(ids[:, :1], **cache_kwargs(cache), use_cache=True)
            cache.batch_repeat_interleave(3)
            copies = llama(later, **cache_kwargs(cache), use_cache=True).logits
            cache.batch_select_indices(torch.tensor([2, 0]))
            reordered = llama(later[:2, :1], **cache_kwargs(cache), use_cache=True).logits
        assert isinstance(cache.layers[0].keys, PackedSlots) == packed
        outs[packed] = (copies, reordered)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
