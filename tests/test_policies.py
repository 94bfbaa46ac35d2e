"""TOVA, SnapKV and random eviction: against the slow reference or hand-computed selections."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt
from reference import reference_generate, reference_logits

from h2o_kv import POLICIES, H2OCache, load_model
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.policies import EntryView, Random, SnapKV, make_policy
from h2o_kv.policies.random import random_keys


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return {family: load_model(tiny_models[family], device="cpu")[0] for family in ("llama", "opt", "gpt_neox")}


def kept_positions(cache: H2OCache, layer: int, head: int, batch: int = 0) -> set[int]:
    lay = cache.layers[layer]
    return set(lay.pos[batch, head][lay.valid[batch, head]].tolist())


def test_registry_and_bad_options():
    assert {"tova", "snapkv", "random"} <= set(POLICIES)
    assert make_policy("snapkv", 3, 4).capacity == 7
    for bad in (dict(window=0), dict(kernel=4), dict(kernel=0), dict(pooling="min")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_policy("snapkv", 3, 4, **bad)
    with pytest.raises(ValueError, match="seed"):
        make_policy("random", 3, 4, seed=-1)
    with pytest.raises(TypeError):
        H2OCache(heavy=3, recent=4, policy="tova", window=8)  # TOVA takes no window


# -- TOVA ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_tova_matches_reference(tiny, family):
    model = tiny[family]
    ids = random_prompt(40, seed=5)
    expected, expected_logits = reference_generate(model, ids, 20, heavy=5, recent=7, policy="tova")
    cache = H2OCache(heavy=5, recent=7, policy="tova")
    tokens, logits = greedy_generate(model, ids, cache, 20)
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0], expected_logits, atol=1e-4, rtol=1e-4)
    assert cache.stats()["kv_tokens"] == 12


def test_tova_stepwise_matches_reference_and_differs_from_h2o(tiny):
    model, ids = tiny["llama"], random_prompt(48, seed=7)
    with torch.no_grad():
        tova = model(ids, **cache_kwargs(H2OCache(heavy=4, recent=4, policy="tova", stepwise=True))).logits[0]
        h2o = model(ids, **cache_kwargs(H2OCache(heavy=4, recent=4, policy="h2o", stepwise=True))).logits[0]
    torch.testing.assert_close(tova, reference_logits(model, ids, 4, 4, "tova"), atol=1e-4, rtol=1e-4)
    assert (tova - h2o).abs().max() > 1e-2  # the two policies really keep different entries


def test_tova_has_no_protected_recent_window(tiny):
    """With TOVA the just-written token may be the one evicted, so the newest column is not always kept."""
    model, ids = tiny["llama"], random_prompt(64, seed=2)
    newest_evicted = 0
    cache = H2OCache(heavy=2, recent=2, policy="tova")
    with torch.no_grad():
        model(ids[:, :8], **cache_kwargs(cache))
        for t in range(8, 64):
            model(ids[:, t : t + 1], **cache_kwargs(cache))
            newest_evicted += sum(
                t not in kept_positions(cache, layer, head) for layer in range(2) for head in range(2)
            )
    assert newest_evicted > 0


# -- H2O with mean scores -----------------------------------------------------------------------------------


def test_h2o_mean_matches_reference_and_differs_from_h2o(tiny):
    model, ids = tiny["llama"], random_prompt(40, seed=3)
    expected, expected_logits = reference_generate(model, ids, 20, heavy=5, recent=7, policy="h2o_mean")
    cache = H2OCache(heavy=5, recent=7, policy="h2o_mean")
    tokens, logits = greedy_generate(model, ids, cache, 20)
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0], expected_logits, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        mean = model(ids, **cache_kwargs(H2OCache(heavy=4, recent=4, policy="h2o_mean", stepwise=True))).logits[0]
        summed = model(ids, **cache_kwargs(H2OCache(heavy=4, recent=4, policy="h2o", stepwise=True))).logits[0]
    torch.testing.assert_close(mean, reference_logits(model, ids, 4, 4, "h2o_mean"), atol=1e-4, rtol=1e-4)
    assert (mean - summed).abs().max() > 1e-2  # a different ranking really keeps different entries


# -- SnapKV -------------------------------------------------------------------------------------------------


def test_snapkv_pooling_by_hand():
    """Scores pooled over neighbours in position order, whatever the slot order; invalid slots never count."""
    pos = torch.tensor([[[5, 0, 3, 1, 9, 4, 2, 6, 7]]])
    valid = torch.tensor([[[True, True, True, True, False, True, True, True, True]]])
    scores = torch.tensor([[[0.0, 1.0, 5.0, 0.0, 100.0, 0.0, 0.0, 8.0, 9.0]]])
    entries = EntryView(pos=pos, valid=valid, scores=scores, seen=8, start=torch.tensor([0]))
    # candidates in position order 0..5 have scores [1, 0, 0, 5, 0, 0]; positions 6 and 7 are the window
    max_pooled = {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0, 4: 5.0, 5: 0.0}
    avg_pooled = {0: 1 / 3, 1: 1 / 3, 2: 5 / 3, 3: 5 / 3, 4: 5 / 3, 5: 0.0}
    for pooling, expected in (("max", max_pooled), ("avg", avg_pooled)):
        rank = SnapKV(heavy=3, recent=3, window=2, kernel=3, pooling=pooling).keep_score(entries)[0, 0]
        for slot, column in enumerate(pos[0, 0].tolist()):
            if column in expected:
                assert rank[slot].item() == pytest.approx(expected[column]), (pooling, column)
            elif column in (6, 7):
                assert rank[slot].item() == float("inf")
    # a window wider than the budget protects only the newest `capacity` entries
    rank = SnapKV(heavy=1, recent=1, window=5, kernel=1).keep_score(entries)[0, 0]
    assert [c for c, r in zip(pos[0, 0].tolist(), rank.tolist(), strict=True) if r == float("inf")] == [6, 7]


def _pool(values: list[float], kernel: int, pooling: str) -> list[float]:
    half, n = kernel // 2, len(values)
    windows = [[values[j] for j in range(i - half, i + half + 1) if 0 <= j < n] for i in range(n)]
    return [max(w) if pooling == "max" else sum(w) / kernel for w in windows]


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_prompt_selection_by_hand(tiny, pooling):
    """The kept prompt entries equal a plain computation from eager full attention, and decode evicts nothing."""
    model, length, window, kernel, heavy, recent = tiny["llama"], 40, 6, 5, 7, 5
    ids = random_prompt(length, seed=11)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        try:
            attentions = model(ids, output_attentions=True).attentions  # [1, Hq, L, L] per layer
        finally:
            model.set_attn_implementation("h2o")
    cache = H2OCache(heavy=heavy, recent=recent, policy="snapkv", window=window, kernel=kernel, pooling=pooling)
    tokens, _ = greedy_generate(model, ids, cache, 6)
    kv_heads = cache.layers[0].keys.shape[1]
    for layer, attention in enumerate(attentions):
        group = attention.shape[1] // kv_heads
        for head in range(kv_heads):
            mass = attention[0, head * group : (head + 1) * group, -window:].double().sum(dim=(0, 1))
            pooled = _pool(mass[: length - window].tolist(), kernel, pooling)
            kept = kept_positions(cache, layer, head)
            generated = set(range(length, length + 6 - 1))  # the last generated token is never fed back
            assert kept >= set(range(length - window, length)) | generated
            chosen = kept - set(range(length - window, length)) - generated
            assert len(chosen) == heavy + recent - window
            # the chosen ones are the best pooled scores (max pooling makes ties: any tie-break is right)
            others = set(range(length - window)) - chosen
            assert min(pooled[i] for i in chosen) >= max(pooled[i] for i in others) - 1e-6, (layer, head)
    assert cache.stats()["kv_tokens"] == heavy + recent + 5


# -- random -------------------------------------------------------------------------------------------------


def test_random_keeps_recent_plus_a_seeded_random_subset(tiny):
    model, ids, heavy, recent = tiny["llama"], random_prompt(40, seed=4), 6, 4

    def run(seed):
        cache = H2OCache(heavy=heavy, recent=recent, policy="random", seed=seed, stepwise=True)
        with torch.no_grad():
            logits = model(ids, **cache_kwargs(cache)).logits
        return cache, logits

    cache, logits = run(3)
    for head in range(2):
        keys = random_keys(3, torch.arange(40 - recent).view(1, 1, -1).expand(1, 2, -1), torch.tensor([0]))[0, head]
        expected = set(keys.topk(heavy).indices.tolist()) | set(range(40 - recent, 40))
        for layer in range(2):
            assert kept_positions(cache, layer, head) == expected
    again, logits_again = run(3)
    assert torch.equal(logits, logits_again)
    other, _ = run(4)
    assert kept_positions(other, 0, 0) != kept_positions(cache, 0, 0)


def test_random_subset_ignores_batch_padding(tiny):
    model = tiny["opt"]
    short, long = random_prompt(30, seed=8), random_prompt(38, seed=9)
    batch = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :8] = 0
    expected_short, _ = greedy_generate(model, short, H2OCache(heavy=5, recent=5, policy="random"), 12)
    expected_long, _ = greedy_generate(model, long, H2OCache(heavy=5, recent=5, policy="random"), 12)
    tokens, _ = greedy_generate(model, batch, H2OCache(heavy=5, recent=5, policy="random"), 12, attention_mask=mask)
    assert tokens[0].tolist() == expected_short[0].tolist()
    assert tokens[1].tolist() == expected_long[0].tolist()


def test_random_keys_are_uniform_and_seeded():
    pos = torch.arange(20000).view(1, 1, -1)
    keys = random_keys(0, pos, torch.tensor([0]))
    assert 0 <= keys.min() and keys.max() < 1 and abs(keys.mean().item() - 0.5) < 0.01
    assert keys.unique().numel() == keys.numel()
    assert not torch.equal(keys, random_keys(1, pos, torch.tensor([0])))
    assert torch.equal(random_keys(0, pos + 5, torch.tensor([5])), keys)  # relative to the first real token
    assert Random(heavy=1, recent=1, seed=2).describe() == "random(heavy=1, recent=1, seed=2)"
