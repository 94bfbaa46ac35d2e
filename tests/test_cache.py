"""H2OCache against the slow reference, plain generate, padding, multi-turn, bounds and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt
from reference import reference_generate, reference_logits

from h2o_kv import H2OCache, load_model
from h2o_kv.hf.cache import H2OLayer
from h2o_kv.hf.compat import cache_kwargs

FAMILIES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")


@pytest.fixture(scope="module")
def tiny(tiny_models):
    """family -> model with the h2o attention enabled (via load_model on the saved directory)."""
    return {family: load_model(path, device="cpu")[0] for family, path in tiny_models.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "tova"])
def test_matches_reference(tiny, family, policy):
    model = tiny[family]
    ids = random_prompt(48)
    expected, expected_logits = reference_generate(model, ids, 24, heavy=6, recent=10, policy=policy)
    cache = H2OCache(heavy=6, recent=10, policy=policy)
    tokens, logits = greedy_generate(model, ids, cache, 24)
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0], expected_logits, atol=1e-4, rtol=1e-4)
    assert cache.stats()["evicted_tokens"] > 0


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_heavy_only_and_recent_only_match_reference(tiny, family):
    ids = random_prompt(40, seed=3)
    for heavy, recent in ((12, 0), (0, 12), (1, 1)):
        expected, _ = reference_generate(tiny[family], ids, 16, heavy=heavy, recent=recent)
        tokens, _ = greedy_generate(tiny[family], ids, H2OCache(heavy=heavy, recent=recent), 16)
        assert tokens[0].tolist() == expected[0], (heavy, recent)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_multi_turn_matches_reference(tiny, family):
    """A second generate call on the same cache continues at the right positions, with eviction."""
    model = tiny[family]
    ids, turn = random_prompt(40), random_prompt(12, seed=7)[0].tolist()
    expected, expected_logits = reference_generate(model, ids, 10, heavy=6, recent=8, turns=[turn])
    cache = H2OCache(heavy=6, recent=8)
    first, logits1 = greedy_generate(model, ids, cache, 10)
    history = torch.cat([ids, first, torch.tensor([turn])], dim=1)
    assert cache.get_seq_length() == ids.shape[1] + 9  # the last generated token is not fed yet
    second, logits2 = greedy_generate(model, history, cache, 10)
    assert [first[0].tolist(), second[0].tolist()] == expected
    torch.testing.assert_close(torch.cat([logits1[0], logits2[0]]), expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_covering_everything_equals_plain_generate(tiny, family):
    model = tiny[family]
    ids = random_prompt(30)
    plain = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0
    )
    with pytest.warns(UserWarning, match="nothing is evicted"):
        cache = H2OCache(heavy=40, recent=40)
        tokens, _ = greedy_generate(model, ids, cache, 20)
    assert torch.equal(tokens, plain[:, 30:])
    assert cache.stats()["evicted_tokens"] == 0
    with pytest.warns(UserWarning, match="nothing is evicted"):  # budget=1.0: H + R = L, eviction starts after
        tokens, _ = greedy_generate(model, ids, H2OCache(budget=1.0), 1)
    assert torch.equal(tokens, plain[:, 30:31])


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt_neox"])
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_padded_batch_equals_one_by_one(tiny, family, policy):
    model = tiny[family]
    lengths = (44, 29, 36)
    prompts = [random_prompt(n, seed=n)[0] for n in lengths]
    width = max(lengths)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(prompts):
        batch[row, width - len(ids) :] = ids
        mask[row, width - len(ids) :] = 1
    batched, batched_logits = greedy_generate(model, batch, H2OCache(heavy=5, recent=7, policy=policy), 16, mask)
    for row, ids in enumerate(prompts):
        single, single_logits = greedy_generate(model, ids[None], H2OCache(heavy=5, recent=7, policy=policy), 16)
        assert batched[row].tolist() == single[0].tolist(), f"row {row}"
        torch.testing.assert_close(batched_logits[row], single_logits[0], atol=1e-4, rtol=1e-4)


def test_every_layer_stays_bounded(tiny, monkeypatch):
    """No layer ever holds more than heavy + recent + 1 entries per sequence and head, nor allocates more slots."""
    heavy, recent = 5, 9
    worst = {"entries": 0, "slots": 0}

    def watch(original):
        def watched(self, *args):
            worst["entries"] = max(worst["entries"], int(self.entry_count().max()))
            original(self, *args)
            worst["entries"] = max(worst["entries"], int(self.entry_count().max()))
            worst["slots"] = max(worst["slots"], self.slots)

        return watched

    for name in ("keep", "append", "evict"):
        monkeypatch.setattr(H2OLayer, name, watch(getattr(H2OLayer, name)))
    cache = H2OCache(heavy=heavy, recent=recent)
    greedy_generate(tiny["llama"], random_prompt(60, batch=2), cache, 30)
    assert worst["entries"] == heavy + recent + 1
    assert worst["slots"] == heavy + recent + 1
    stats = cache.stats()
    assert stats["kv_tokens"] == heavy + recent and stats["seen_tokens"] == 89
    assert stats["kv_bytes"] < stats["full_kv_bytes"] * (heavy + recent + 1) / 89 + 1


def test_stepwise_equals_token_by_token(tiny):
    """One batched stepwise forward == feeding the tokens one at a time through H2OCache == the reference."""
    model, ids = tiny["llama"], random_prompt(50)
    with torch.no_grad():
        fast = model(ids, **cache_kwargs(H2OCache(heavy=6, recent=6, stepwise=True))).logits[0]
        cache = H2OCache(heavy=6, recent=6)
        slow = torch.cat([model(ids[:, i : i + 1], **cache_kwargs(cache)).logits[0] for i in range(ids.shape[1])])
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, reference_logits(model, ids, 6, 6), atol=1e-4, rtol=1e-4)


def test_prefill_query_chunks_do_not_change_results(tiny):
    """Walking the prompt in tiny query chunks (bounded memory) gives the same scores and tokens."""
    ids = random_prompt(64)
    big, big_logits = greedy_generate(tiny["mistral"], ids, H2OCache(heavy=8, recent=8), 12)
    small, small_logits = greedy_generate(tiny["mistral"], ids, H2OCache(heavy=8, recent=8, prefill_chunk_mb=0.001), 12)
    assert torch.equal(big, small)
    torch.testing.assert_close(big_logits, small_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_fp32(tiny, tiny_models, family, dtype):
    """fp16/bf16 against the fp32 model with the same weights, evicting at every step (heavy 6 + recent 10 of 72).

    Tolerance: 4 * eps(dtype) * the largest |logit| (fp16: eps 2**-10, ~2.7e-3 here; bf16: eps 2**-7, ~2.2e-2): each
    of the two layers rounds its activations to the dtype (relative error ~eps each); measured: ~1 eps (fp16 8e-4,
    bf16 6.5e-3). Teacher-forced on fp32's greedy tokens, so one flipped token cannot derail the rest; the kept
    entries must be the same ones. Free-running, the greedy tokens must agree up to the first step where fp32's top
    two logits are closer than twice the tolerance (there rounding may legitimately pick the other one).
    """
    ids, new = random_prompt(48), 24
    tokens, logits = greedy_generate(tiny[family], ids, H2OCache(heavy=6, recent=10), new)
    model = load_model(tiny_models[family], dtype=dtype, device="cpu")[0]
    forced = torch.cat([ids, tokens], dim=1)[:, :-1]

    def teacher_forced(lm):
        cache = H2OCache(heavy=6, recent=10, stepwise=True)  # every token a decode step with eviction
        with torch.no_grad():
            out = lm(forced, **cache_kwargs(cache)).logits[0, ids.shape[1] - 1 :].float()
        kept = [layer.pos.masked_fill(~layer.valid, -1).sort(-1).values for layer in cache.layers]
        return out, kept, cache

    want, want_kept, _ = teacher_forced(tiny[family])
    got, got_kept, cache = teacher_forced(model)
    atol = 4 * torch.finfo(dtype).eps * want.abs().max().item()
    assert cache.layers[0].keys.dtype == dtype and cache.stats()["kv_tokens"] == 16
    assert all(torch.equal(a, b) for a, b in zip(got_kept, want_kept, strict=True))
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    top2 = logits[0].topk(2, dim=-1).values
    close = ((top2[:, 0] - top2[:, 1]) < 2 * atol).nonzero()
    agree = int(close[0]) if len(close) else new
    half_tokens, _ = greedy_generate(model, ids, H2OCache(heavy=6, recent=10), new)
    assert torch.equal(half_tokens[:, :agree], tokens[:, :agree]), agree


def test_budget_ratio_uses_longest_prompt(tiny):
    cache = H2OCache(budget=0.2)
    greedy_generate(tiny["llama"], random_prompt(100), cache, 4)
    assert (cache.heavy, cache.recent) == (10, 10)
    assert cache.stats()["kv_tokens"] == 20


def test_without_h2o_attention_the_cache_refuses(tiny, tiny_models):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], attn_implementation="sdpa")
    with pytest.raises(RuntimeError, match="enable_h2o"):
        plain(random_prompt(20), **cache_kwargs(H2OCache(heavy=4, recent=4)))
    # the failed forward leaves nothing behind: the next cache in this thread works
    expected, _ = reference_generate(tiny["llama"], random_prompt(30), 6, heavy=4, recent=4)
    tokens, _ = greedy_generate(tiny["llama"], random_prompt(30), H2OCache(heavy=4, recent=4), 6)
    assert tokens[0].tolist() == expected[0]


def test_reset_after_an_across_layers_prompt(tiny):
    """reset() drops a pending across-layers selection: the next prompt runs as in a fresh cache."""
    model, ids = tiny["llama"], random_prompt(30)
    cache = H2OCache(heavy=4, recent=4, policy="global_h2o")
    with torch.no_grad():
        model(random_prompt(20, seed=3), **cache_kwargs(cache))
    assert cache.selection_pending
    cache.reset()
    assert not cache.selection_pending
    again, again_logits = greedy_generate(model, ids, cache, 5)
    fresh, fresh_logits = greedy_generate(model, ids, H2OCache(heavy=4, recent=4, policy="global_h2o"), 5)
    assert torch.equal(again, fresh) and torch.equal(again_logits, fresh_logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(heavy=-1, recent=4), "heavy must be an integer >= 0"),
        (dict(heavy=4, recent=-2), "recent must be an integer >= 0"),
        (dict(heavy=4.5, recent=4), "heavy must be an integer"),
        (dict(heavy=4), "recent is required"),
        (dict(heavy=0, recent=0), "heavy \\+ recent must be >= 1"),
        (dict(budget=0.0), "budget must be a ratio in \\(0, 1\\]"),
        (dict(budget=1.5), "budget must be a ratio in \\(0, 1\\]"),
        (dict(budget=-0.2), "budget must be a ratio"),
        (dict(budget=0.2, heavy=4), "either budget .* or heavy/recent"),
        (dict(heavy=4, recent=4, policy="nope"), "policy must be one of"),
        (dict(heavy=4, recent=4, prefill_chunk_mb=0), "prefill_chunk_mb must be > 0"),
        (dict(), "give budget .* or heavy and recent"),
        (dict(budget=0.2, policy="full"), "keeps every entry: give no budget"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        H2OCache(**kwargs)


def test_budget_of_a_short_prompt_keeps_one_entry_of_each(tiny):
    """floor(0.2 * 4 / 2) = 0: the rule keeps at least one heavy and one recent entry (h2o_kv.Budget)."""
    cache = H2OCache(budget=0.2)
    greedy_generate(tiny["llama"], random_prompt(4), cache, 6)
    assert (cache.heavy, cache.recent) == (1, 1)
    assert cache.stats()["kv_tokens"] == 2
