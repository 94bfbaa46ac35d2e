"""Streaming mode (position rolling): keys stored before RoPE and re-rotated at their rank inside the cache."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import quiet_generate
from transformers import AutoModelForCausalLM, LlamaConfig

import h2o_kv
from h2o_kv import H2OCache
from h2o_kv.hf import rotary
from h2o_kv.hf.cache import H2OBudgetWarning
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.models import load_model

ROPE_FAMILIES = ("llama", "mistral", "qwen2", "gpt_neox")  # gpt_neox: partial rotary (rotary_pct 0.25)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    """family -> tiny model with the 'h2o' attention (and the rotary table registered)."""
    return {family: load_model(path)[0] for family, path in tiny_models.items()}


@pytest.mark.parametrize("rotary_dim", [16, 4])
def test_unrotate_inverts_rotate(rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    angles = torch.randn(2, 5, rotary_dim // 2) * 1000  # large absolute positions
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos() * 1.3, emb.sin() * 1.3  # with a YaRN-style attention scaling factor
    y = rotary.rotate(x, cos[:, None], sin[:, None])
    assert not torch.allclose(y, x)
    torch.testing.assert_close(rotary.unrotate(y, cos[:, None], sin[:, None]), x, atol=1e-5, rtol=1e-5)
    if rotary_dim < 16:
        assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])  # partial rotary passes the rest through
    # what the cache stores: the un-rotated key in pair order (each RoPE pair side by side)
    raw = rotary.raw_keys(y, cos, sin)
    torch.testing.assert_close(raw, x.index_select(-1, rotary.pair_order(16, rotary_dim)), atol=1e-5, rtol=1e-5)


def test_pair_order_is_a_permutation():
    order = rotary.pair_order(16, 8)
    assert sorted(order.tolist()) == list(range(16))
    assert order[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.filterwarnings("ignore::h2o_kv.hf.cache.H2OBudgetWarning")  # the point of the test
@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_same_tokens_as_plain_cache_while_nothing_is_evicted(tiny, family):
    """Budget larger than the sequence: in-cache positions equal absolute ones, so streaming changes nothing."""
    model = tiny[family]
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    plain = quiet_generate(model, ids, H2OCache(heavy=64, recent=64), 40)
    streamed = quiet_generate(model, ids, H2OCache(heavy=64, recent=64, streaming=True), 40)
    assert torch.equal(plain, streamed)
    with torch.no_grad():  # teacher-forced logits, prompt-chunk path and stepwise path
        reference = model(ids, **cache_kwargs(H2OCache(heavy=64, recent=64))).logits
        chunk = model(ids, **cache_kwargs(H2OCache(heavy=64, recent=64, streaming=True))).logits
        steps = model(ids, **cache_kwargs(H2OCache(heavy=64, recent=64, streaming=True, stepwise=True))).logits
    torch.testing.assert_close(chunk, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["h2o", "sink", "local"])
def test_runs_three_times_past_the_window_with_bounded_layers(tiny, policy, monkeypatch):
    model = tiny["llama"]
    limit = model.config.max_position_embeddings  # 256
    heavy, recent = 16, 16
    seen_positions = []
    lookup = rotary.PositionRoller._lookup

    def recording_lookup(self, positions, *table):
        seen_positions.append(int(positions.max()))
        return lookup(self, positions, *table)

    monkeypatch.setattr(rotary.PositionRoller, "_lookup", recording_lookup)
    cache = H2OCache(heavy=heavy, recent=recent, policy=policy, streaming=True)
    ids = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    new = 3 * limit
    out = quiet_generate(model, ids, cache, new, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape[1] == 24 + new
    assert torch.isfinite(torch.stack(out.logits)).all()  # past the window, still finite
    stats = cache.stats()
    assert stats["seen_tokens"] == 24 + new - 1  # the last token is never fed back
    assert stats["peak_kv_tokens"] <= heavy + recent + 1
    for layer in cache.layers:
        assert layer.slots <= heavy + recent + 1
        assert int(layer.entry_count().max()) <= heavy + recent
    assert 0 < max(seen_positions) <= heavy + recent  # the model never saw a position past the cache size


def test_stepwise_long_text_stays_finite_and_bounded(tiny):
    model = tiny["gpt_neox"]
    ids = torch.randint(3, 512, (1, 3 * model.config.max_position_embeddings + 10))
    cache = H2OCache(heavy=8, recent=24, streaming=True, stepwise=True)
    with torch.no_grad():
        logits = torch.cat([model(part, **cache_kwargs(cache)).logits for part in ids.split(200, dim=1)], dim=1)
    assert logits.shape[1] == ids.shape[1] and torch.isfinite(logits).all()
    assert cache.stats()["kv_tokens"] == 32 and max(layer.slots for layer in cache.layers) <= 33


def _one_layer_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(8)
        model.model.layers[0].self_attn.k_proj.weight.mul_(8)
    return h2o_kv.enable_h2o(model)


def test_sink_stream_equals_recomputing_the_kept_window():
    """StreamingLLM semantics, exactly: with one layer the keys/values of a token depend on the token alone, so
    a streaming step must equal a fresh forward over the kept tokens at positions 0..n-1 (sinks + recent)."""
    model = _one_layer_llama()
    ids = torch.randint(3, 512, (1, 200), generator=torch.Generator().manual_seed(3))
    sinks, capacity = 2, 8
    with torch.no_grad():
        cache = H2OCache(heavy=4, recent=4, policy="sink", sinks=sinks, stepwise=True, streaming=True)
        streamed = model(ids, **cache_kwargs(cache)).logits[0]
        plain = model(ids, **cache_kwargs(H2OCache(heavy=4, recent=4, policy="sink", sinks=sinks, stepwise=True)))
        for t in (capacity, 63, 64, 150, 199):  # before and far past max_position_embeddings = 64
            kept = torch.cat([ids[0, :sinks], ids[0, t - (capacity - sinks) : t + 1]])
            fresh = model(kept[None]).logits[0, -1]
            torch.testing.assert_close(streamed[t], fresh, atol=1e-5, rtol=1e-5)
        # without streaming the kept keys keep their absolute positions: a different computation
        t = 150
        kept = torch.cat([ids[0, :sinks], ids[0, t - (capacity - sinks) : t + 1]])
        assert (plain.logits[0, t] - model(kept[None]).logits[0, -1]).abs().max() > 1e-3


def test_padded_batch_equals_single_sequences(tiny):
    """In-cache positions count real entries only, so left padding does not shift them."""
    model = tiny["llama"]
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, 512, (1, 30), generator=gen), torch.randint(3, 512, (1, 20), generator=gen)
    single = [quiet_generate(model, x, H2OCache(heavy=8, recent=8, streaming=True), 30)[0, -30:] for x in (a, b)]
    batch = torch.cat([a, torch.cat([torch.zeros(1, 10, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :10] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=H2OBudgetWarning)
        out = model.generate(
            batch, attention_mask=mask, **cache_kwargs(H2OCache(heavy=8, recent=8, streaming=True)),
            max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(out[0, -30:], single[0]) and torch.equal(out[1, -30:], single[1])


def test_streaming_rejects_models_without_rope(tiny):
    with pytest.raises(ValueError, match="learned absolute positions"):
        quiet_generate(tiny["opt"], torch.randint(3, 512, (1, 8)), H2OCache(heavy=4, recent=4, streaming=True), 2)


def test_streaming_needs_enable_h2o(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    h2o_kv.register_attention()
    model.set_attn_implementation("h2o")  # no enable_h2o: the rotary table is unknown
    with pytest.raises(RuntimeError, match="enable_h2o"):
        quiet_generate(model, torch.randint(3, 512, (1, 8)), H2OCache(heavy=4, recent=4, streaming=True), 2)


def test_streaming_bad_settings():
    with pytest.raises(ValueError, match="heavy \\+ recent must be >= 1"):
        H2OCache(heavy=0, recent=0, streaming=True)
    with pytest.raises(ValueError, match="bounded policy"):
        H2OCache(policy="full", streaming=True)


def test_long_prompt_chunk_warns_past_the_window(tiny):
    model = tiny["llama"]
    ids = torch.randint(3, 512, (1, model.config.max_position_embeddings + 20))
    with pytest.warns(UserWarning, match="stepwise=True"), torch.no_grad():
        model(ids, **cache_kwargs(H2OCache(heavy=8, recent=8, streaming=True)))


@pytest.mark.filterwarnings("ignore::h2o_kv.hf.cache.H2OBudgetWarning")
def test_sliding_window_counts_in_cache_positions():
    """Mistral-style sliding window (64) with 32 kept entries: it never binds in streaming mode, so sinks stay
    visible however far back they are; a cache as large as the window is refused."""
    from transformers import MistralConfig

    def tiny_mistral(window):
        torch.manual_seed(0)
        config = MistralConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=window,
        )  # fmt: skip
        return h2o_kv.enable_h2o(AutoModelForCausalLM.from_config(config).eval())

    ids = torch.randint(3, 512, (1, 300), generator=torch.Generator().manual_seed(6))
    logits = []
    for window in (None, 64):
        cache = H2OCache(heavy=16, recent=16, policy="sink", streaming=True, stepwise=True)
        with torch.no_grad():
            logits.append(tiny_mistral(window)(ids, **cache_kwargs(cache)).logits)
    torch.testing.assert_close(logits[0], logits[1])
    with pytest.raises(ValueError, match="sliding_window=64"), torch.no_grad():
        tiny_mistral(64)(ids[:, :8], **cache_kwargs(H2OCache(heavy=32, recent=32, streaming=True, stepwise=True)))
