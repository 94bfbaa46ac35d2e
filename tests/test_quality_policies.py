"""A2SF, KeyDiff, the question-aware H2O and head-adaptive budgets: reference equalities and properties."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import greedy_generate, random_prompt
from reference import reference_generate

from h2o_kv import POLICIES, H2OCache, load_model
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.policies import AdaH2O, GlobalH2O, make_policy


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return {family: load_model(tiny_models[family], device="cpu")[0] for family in ("llama", "gpt_neox")}


def kept(cache: H2OCache, layer: int, head: int) -> set[int]:
    lay = cache.layers[layer]
    return set(lay.pos[0, head][lay.valid[0, head]].tolist())


def all_kept(cache: H2OCache) -> list[list[set[int]]]:
    return [[kept(cache, i, h) for h in range(lay.keys.shape[1])] for i, lay in enumerate(cache.layers)]


def test_registry_and_bad_options():
    assert {"a2sf", "keydiff", "window_h2o", "ada_h2o", "ada_snapkv", "ada_window_h2o"} <= set(POLICIES)
    for name, bad in (("a2sf", dict(decay=0)), ("a2sf", dict(decay=1.5)), ("window_h2o", dict(window=0)),
                      ("ada_snapkv", dict(alpha=-0.1)), ("ada_snapkv", dict(kernel=4))):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_policy(name, 3, 4, **bad)
    assert "alpha=0.2" in make_policy("ada_snapkv", 3, 4).describe()
    with pytest.raises(ValueError, match="head-adaptive"):
        H2OCache(heavy=4, recent=4, policy="ada_h2o", streaming=True)


# -- A2SF ---------------------------------------------------------------------------------------------------


def test_a2sf_decay_one_is_h2o(tiny):
    model, ids = tiny["llama"], random_prompt(40, seed=5)
    caches = [H2OCache(heavy=5, recent=7, policy="h2o"), H2OCache(heavy=5, recent=7, policy="a2sf", decay=1.0)]
    (h2o_tokens, h2o_logits), (a2sf_tokens, a2sf_logits) = (greedy_generate(model, ids, c, 20) for c in caches)
    assert a2sf_tokens.tolist() == h2o_tokens.tolist()
    assert torch.equal(a2sf_logits, h2o_logits)
    for h2o_layer, a2sf_layer in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(h2o_layer.pos, a2sf_layer.pos) and torch.equal(h2o_layer.scores, a2sf_layer.scores)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a2sf_matches_reference_and_differs_from_h2o(tiny, family):
    model, ids = tiny[family], random_prompt(40, seed=3)
    expected, expected_logits = reference_generate(model, ids, 24, heavy=5, recent=7, policy="a2sf", decay=0.8)
    cache = H2OCache(heavy=5, recent=7, policy="a2sf", decay=0.8)
    tokens, logits = greedy_generate(model, ids, cache, 24)
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0], expected_logits, atol=1e-4, rtol=1e-4)
    h2o = H2OCache(heavy=5, recent=7, policy="h2o")
    greedy_generate(model, ids, h2o, 24)
    assert all_kept(h2o) != all_kept(cache)  # forgetting really changes the kept entries


# -- KeyDiff ------------------------------------------------------------------------------------------------


def test_keydiff_prompt_selection_by_hand(tiny):
    """Kept prompt entries: the recent window plus the keys least similar to the mean normalised key of the head."""
    from transformers import DynamicCache

    model, length, heavy, recent = tiny["llama"], 40, 9, 5
    ids = random_prompt(length, seed=8)
    with torch.no_grad():
        plain = DynamicCache()
        model(ids, **cache_kwargs(plain), use_cache=True)
        cache = H2OCache(heavy=heavy, recent=recent, policy="keydiff")
        model(ids, **cache_kwargs(cache), use_cache=True)
    assert not cache.policy.needs_attention and cache.policy.needs_keys
    for layer in range(len(cache.layers)):
        keys = plain.layers[layer].keys[0].double()  # [kv_heads, L, D], rotated at their positions
        unit = keys / keys.norm(dim=-1, keepdim=True)
        anchor = unit.mean(1, keepdim=True)
        score = -(unit * anchor).sum(-1) / anchor.norm(dim=-1)
        for head in range(keys.shape[0]):
            best = score[head, : length - recent].topk(heavy).indices.tolist()
            assert kept(cache, layer, head) == set(best) | set(range(length - recent, length)), (layer, head)
    assert float(cache.layers[0].scores.abs().max()) == 0.0  # no attention mass is ever computed


def test_keydiff_evicts_at_every_decode_step(tiny):
    cache = H2OCache(heavy=6, recent=4, policy="keydiff")
    greedy_generate(tiny["gpt_neox"], random_prompt(30, seed=2), cache, 12)
    stats = cache.stats()
    assert stats["kv_tokens"] == 10 and stats["slots"] == 11


# -- the question-aware H2O -----------------------------------------------------------------------------------


def test_window_h2o_with_a_window_over_the_whole_prompt_is_h2o(tiny):
    model, ids = tiny["llama"], random_prompt(40, seed=6)
    caches = [H2OCache(heavy=5, recent=7, policy="h2o"), H2OCache(heavy=5, recent=7, policy="window_h2o", window=40)]
    (h2o_tokens, h2o_logits), (tokens, logits) = (greedy_generate(model, ids, c, 16) for c in caches)
    assert tokens.tolist() == h2o_tokens.tolist()
    torch.testing.assert_close(logits, h2o_logits, atol=1e-5, rtol=1e-5)
    assert all_kept(caches[0]) == all_kept(caches[1])


def test_window_h2o_prompt_by_window_then_h2o_accumulation(tiny):
    """Prompt: the heavy entries are the best by the last ``window`` rows' eager attention; then one eviction a
    step; the scores of the kept prompt entries are window mass + every later step's mass (H2O's running sum)."""
    model, length, window, heavy, recent = tiny["llama"], 40, 6, 8, 6
    ids = random_prompt(length, seed=12)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        try:
            attentions = model(ids, output_attentions=True).attentions
        finally:
            model.set_attn_implementation("h2o")
        cache = H2OCache(heavy=heavy, recent=recent, policy="window_h2o", window=window)
        model(ids, **cache_kwargs(cache), use_cache=True)
    kv_heads = cache.layers[0].keys.shape[1]
    for layer, attention in enumerate(attentions):
        group = attention.shape[1] // kv_heads
        for head in range(kv_heads):
            mass = attention[0, head * group : (head + 1) * group, -window:].double().sum(dim=(0, 1))
            chosen = kept(cache, layer, head) - set(range(length - recent, length))
            others = set(range(length - recent)) - chosen
            assert len(chosen) == heavy
            assert min(mass[i] for i in chosen) >= max(mass[i] for i in others) - 1e-6, (layer, head)
    tokens, _ = greedy_generate(model, ids, cache, 8)
    assert cache.stats()["kv_tokens"] == heavy + recent


# -- head-adaptive budgets ----------------------------------------------------------------------------------


def test_head_adaptive_selection_by_hand():
    rank = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [0.5, 0.4, 0.3, 0.2], [5.0, 0.1, -math.inf, 4.0]]])
    index, counts = AdaH2O(heavy=1, recent=1, alpha=0.0).select(rank, 2)  # layer budget 3 heads x 2 = 6
    assert counts.tolist() == [[4, 0, 2]]  # the top 6 of all heads: 9 8 7 6 (head 0), 5 4 (head 2)
    assert sorted(index[0, 0, :4].tolist()) == [0, 1, 2, 3] and sorted(index[0, 2, :2].tolist()) == [0, 3]
    index, counts = AdaH2O(heavy=1, recent=1, alpha=0.5).select(rank, 2)  # safeguard: each head's best 1 first,
    assert counts.tolist() == [[4, 1, 1]] and index[0, 1, 0].item() == 0  # then the best 3 others: 8 7 6
    index, counts = AdaH2O(heavy=1, recent=1, alpha=1.0).select(rank, 2)  # alpha 1: the per-head rule
    assert counts.tolist() == [[2, 2, 2]]
    assert [set(index[0, h, :2].tolist()) for h in range(3)] == [{0, 1}, {0, 1}, {0, 3}]


@pytest.mark.parametrize("policy", ["ada_h2o", "global_h2o"])
def test_adaptive_h2o_with_full_safeguard_is_h2o(tiny, policy):
    """``alpha=1``: every head keeps its own best ``capacity`` first, which is the whole budget: exactly ``h2o``."""
    model, ids = tiny["llama"], random_prompt(40, seed=9)
    caches = [H2OCache(heavy=5, recent=7, policy="h2o"), H2OCache(heavy=5, recent=7, policy=policy, alpha=1.0)]
    (h2o_tokens, h2o_logits), (tokens, logits) = (greedy_generate(model, ids, c, 16) for c in caches)
    assert tokens.tolist() == h2o_tokens.tolist()
    torch.testing.assert_close(logits, h2o_logits, atol=1e-5, rtol=1e-5)
    assert all_kept(caches[0]) == all_kept(caches[1])


@pytest.mark.parametrize("policy, options", [("ada_h2o", {}), ("ada_window_h2o", {"window": 16}),
                                             ("ada_snapkv", {"window": 4})])  # fmt: skip
def test_head_adaptive_keeps_the_layer_total(tiny, policy, options):
    """Per-head counts differ, each layer's valid entries equal heads x capacity after the prompt and (for a policy
    that evicts while decoding) at every later step, and the slots stay within the stated bound."""
    model, ids, heavy, recent, alpha = tiny["llama"], random_prompt(48, seed=4), 6, 6, 0.2
    cache = H2OCache(heavy=heavy, recent=recent, policy=policy, alpha=alpha, **options)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    capacity = heavy + recent
    heads = cache.layers[0].keys.shape[1]
    bound = heads * capacity - (heads - 1) * math.ceil(alpha * capacity) + 1
    assert any(len(set(layer.valid[0].sum(-1).tolist())) > 1 for layer in cache.layers)  # really adaptive
    for layer in cache.layers:
        assert int(layer.valid.sum()) == heads * capacity and layer.slots <= bound
    greedy_generate(model, ids, cache, 10)
    grows = 0 if cache.policy.evicts_during_decode else 9  # snapkv compresses once, then the cache grows
    for layer in cache.layers:
        assert int(layer.valid.sum()) == heads * (capacity + grows)


# -- one budget across layers ---------------------------------------------------------------------------------


def test_across_layers_selection_by_hand():
    ranks = [
        torch.tensor([[[9.0, 8.0, 1.0], [0.5, 0.4, 0.3]]]),
        torch.tensor([[[7.0, 6.0, 5.0], [4.0, -math.inf, 0.1]]]),
    ]
    out = GlobalH2O(heavy=1, recent=1).select_layers(ranks, 1)  # 2 layers x 2 heads x 1 = the top 4 of all
    assert [counts.tolist() for _, counts in out] == [[[2, 0]], [[2, 0]]]  # 9 8 | 7 6
    assert set(out[0][0][0, 0, :2].tolist()) == {0, 1} and set(out[1][0][0, 0, :2].tolist()) == {0, 1}
    out = GlobalH2O(heavy=1, recent=1, alpha=1.0).select_layers(ranks, 1)  # each head's own best: per-head rule
    assert [counts.tolist() for _, counts in out] == [[[1, 1]], [[1, 1]]]
    assert [index[0, :, 0].tolist() for index, _ in out] == [[0, 0], [0, 0]]


@pytest.mark.parametrize("policy, options", [("global_h2o", {}), ("global_window_h2o", {"window": 16}),
                                             ("global_snapkv", {"window": 4})])  # fmt: skip
def test_global_budget_keeps_the_model_total_and_the_best_entries(tiny, policy, options):
    """After the prompt: the model holds exactly layers x heads x capacity entries, layers differ, and every kept
    entry ranks at least as high as every dropped one over the whole model; then the total holds (or grows by one
    entry per head and step for SnapKV, which compresses once)."""
    model, ids, heavy, recent = tiny["llama"], random_prompt(48, seed=4), 6, 6
    cache = H2OCache(heavy=heavy, recent=recent, policy=policy, **options)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    assert cache.selection_pending and cache.layers[0].entry_count().max() == 48  # all kept until every layer scored
    ranks = [cache.policy.keep_score(layer.view()) for layer in cache.layers]  # every candidate, before selection
    pos = [layer.pos.clone() for layer in cache.layers]
    cache.select_across_layers()
    capacity, heads, n_layers = heavy + recent, cache.layers[0].keys.shape[1], len(cache.layers)
    assert sum(int(layer.valid.sum()) for layer in cache.layers) == n_layers * heads * capacity
    assert len({int(layer.valid.sum()) for layer in cache.layers}) > 1  # really across layers
    kept_ranks, dropped_ranks = [], []
    for layer, rank, columns in zip(cache.layers, ranks, pos, strict=True):
        for h in range(heads):
            held = set(layer.pos[0, h][layer.valid[0, h]].tolist())
            for column, value in zip(columns[0, h].tolist(), rank[0, h].tolist(), strict=True):
                (kept_ranks if column in held else dropped_ranks).append(value)
    assert min(kept_ranks) >= max(dropped_ranks)
    cache.stepwise = True
    with torch.no_grad():
        for token in random_prompt(9, seed=5)[0]:  # decode steps (the first one would also run the selection)
            model(token.view(1, 1), **cache_kwargs(cache), use_cache=True)
    grows = 0 if cache.policy.evicts_during_decode else 9
    assert sum(int(layer.valid.sum()) for layer in cache.layers) == n_layers * heads * (capacity + grows)


@pytest.mark.parametrize("policy", ["global_h2o", "global_window_h2o"])
def test_recent_share_resplits_the_budget_and_equals_the_same_counts(tiny, policy):
    """``recent_share`` moves entries from the recent window to the pooled ranking, the capacity unchanged: a ratio
    budget's even split re-split to 0.2 runs exactly as heavy/recent counts of that split (tokens, logits and every
    head's kept columns through 12 decode steps), and differs from the even split."""
    assert (
        make_policy(f"{policy}:recent_share=0.2", 5, 5).heavy,
        make_policy(f"{policy}:recent_share=0.2", 5, 5).recent,
    ) == (8, 2)
    assert make_policy(f"{policy}:recent_share=0", 5, 5).recent == 1  # the newest entry stays protected
    assert make_policy(policy, 7, 3).recent == 3  # None: the budget's own split
    model, ids = tiny["llama"], random_prompt(48, seed=6)
    runs = []
    caches = [H2OCache(heavy=5, recent=5, policy=policy, recent_share=0.2), H2OCache(heavy=8, recent=2, policy=policy),
              H2OCache(heavy=5, recent=5, policy=policy)]  # fmt: skip
    for cache in caches:
        tokens, logits = greedy_generate(model, ids, cache, 12)
        runs.append((tokens.tolist(), logits, all_kept(cache)))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2]
    assert runs[0][2] != runs[2][2]
    with pytest.raises(ValueError, match=r"recent_share must be a number in \[0, 1\]"):
        make_policy(policy, 5, 5, recent_share=1.5)


@pytest.mark.parametrize("policy", ["window_h2o", "global_window_h2o"])
def test_decode_grow_compresses_the_prompt_once_then_keeps_every_later_token(tiny, policy):
    """``decode=grow`` (kvpress' protocol): the prompt is compressed exactly as with ``decode=evict`` (same logits;
    after the first later token ``evict`` holds the same entries less one per head), then every later token joins
    the cache and nothing is evicted, while ``evict`` stays at its per-head counts. (A global policy selects at the
    next forward's first layer, so the first later token is where both have compressed the prompt.)"""
    model, ids, later = tiny["llama"], random_prompt(48, seed=6), random_prompt(9, seed=5)[0]
    caches = {decode: H2OCache(heavy=5, recent=5, policy=policy, decode=decode) for decode in ("evict", "grow")}
    logits, first = {}, {}
    with torch.no_grad():
        for decode, cache in caches.items():
            logits[decode] = model(ids, **cache_kwargs(cache), use_cache=True).logits
            cache.stepwise = True
            for step, token in enumerate(later):
                model(token.view(1, 1), **cache_kwargs(cache), use_cache=True)
                first[decode] = all_kept(cache) if step == 0 else first[decode]
    assert torch.equal(logits["evict"], logits["grow"])
    pairs = [(e, g) for layer_e, layer_g in zip(first["evict"], first["grow"], strict=True)
             for e, g in zip(layer_e, layer_g, strict=True)]  # fmt: skip
    assert all(48 in g and e <= g and len(g) == len(e) + 1 for e, g in pairs)
    assert sum(len(e) for e, _ in pairs) == len(pairs) * 10  # the budget: heavy + recent per head on average
    new = set(range(49, 48 + len(later)))
    assert all_kept(caches["grow"]) == [[head | new for head in layer] for layer in first["grow"]]
    assert [[len(h) for h in layer] for layer in all_kept(caches["evict"])] == [
        [len(h) for h in layer] for layer in first["evict"]
    ]
    assert caches["grow"].policy.describe().count("decode=grow") == 1 and caches["evict"].policy.evicts_during_decode
    with pytest.raises(ValueError, match="decode must be one of evict, grow"):
        make_policy(policy, 5, 5, decode="keep")


def test_an_evaluation_reports_the_mean_count_a_global_policy_keeps(tiny):
    """``Session.kept`` (an evaluation record's ``kept``, its ``kv_kept_ratio``) is the mean over layers and heads:
    a global policy holds the model total at unequal counts, so its largest layer is no measure of its memory."""
    from h2o_kv.eval.runner import KVRunner
    from h2o_kv.harness.setting import KVSetting, held_entries

    session = KVRunner(tiny["llama"], KVSetting.of("global_h2o", heavy=6, recent=6)).prefill(random_prompt(48, seed=4))
    assert session.kept == 12 < held_entries(session.cache)  # the mean is the budget; one layer holds more


def test_global_budget_refusals():
    from h2o_kv.registry import ACROSS_LAYERS, POLICY_NAMES
    from h2o_kv.vllm.config import ServeConfig

    with pytest.raises(ValueError, match="kv_bits is not supported with the across-layers policy 'global_h2o'"):
        H2OCache(heavy=2, recent=2, policy="global_h2o", kv_bits=4)
    with pytest.raises(ValueError, match="does not support the head-adaptive policy 'global_snapkv'"):
        H2OCache(heavy=2, recent=2, policy="global_snapkv", streaming=True)
    with pytest.raises(ValueError, match="policy global_h2o shares one budget across all layers"):
        ServeConfig(policy="global_h2o", budget=0.2)
    assert set(POLICY_NAMES) | set(ACROSS_LAYERS) == set(POLICIES)
    assert set(ACROSS_LAYERS) == {name for name, cls in POLICIES.items() if cls.across_layers}


def test_across_layers_selection_with_an_unchanged_slot_count(tiny):
    """A selection whose widest head keeps every candidate leaves the buffer size as it was; the kept flags must
    still be those of the selection (regression: they were cleared before being gathered)."""
    model, ids = tiny["llama"], random_prompt(12, seed=3)
    cache = H2OCache(heavy=5, recent=5, policy="global_snapkv", window=2)  # no decode eviction: slots = width
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    for layer in cache.layers:  # make one head of layer 0 outrank everything, so it keeps all 12 candidates
        layer.scores[:, 0] = 0.0
    cache.layers[0].scores[0, 0] = 1.0
    cache.select_across_layers()
    total = sum(int(layer.valid.sum()) for layer in cache.layers)
    assert cache.layers[0].slots == 12 and int(cache.layers[0].valid[0, 0].sum()) == 12
    assert total == len(cache.layers) * cache.layers[0].keys.shape[1] * 10
