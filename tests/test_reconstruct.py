"""Scoring a prompt by a context-reconstruction pass (``H2OCache.scoring_pass``, ``h2o_kv.hf.reconstruct``)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompt
from typer.testing import CliRunner

from h2o_kv import H2OCache, load_model
from h2o_kv.budget import Budget
from h2o_kv.harness.setting import KVSetting
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.hf.reconstruct import REQUEST, Reconstruction, prefill


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def request_for(prompt: torch.Tensor, extra: int = 5) -> Reconstruction:
    """A tokenizer-free request: ``extra`` fixed ids (the prompt follows them, repeated whole)."""
    return Reconstruction(request=random_prompt(extra, seed=99)[0].tolist(), prefix=[])


def kept(cache: H2OCache, layer: int, head: int) -> set[int]:
    lay = cache.layers[layer]
    return set(lay.pos[0, head][lay.valid[0, head]].tolist())


def test_request_rows_choose_the_kept_entries(llama):
    """The heavy entries are the best by the eager attention the request's rows pay (the policy's window)."""
    length, heavy, recent = 40, 8, 6
    ids = random_prompt(length, seed=21)
    reconstruction = request_for(ids)
    rows = reconstruction.scoring_ids(ids[0].tolist())
    assert len(rows) == 5 + length
    with torch.no_grad():
        llama.set_attn_implementation("eager")
        try:
            attentions = llama(torch.cat([ids, torch.tensor([rows])], dim=1), output_attentions=True).attentions
        finally:
            llama.set_attn_implementation("h2o")
    cache = H2OCache(heavy=heavy, recent=recent, policy="window_h2o")
    prefill(llama, cache, ids, reconstruction)
    kv_heads = cache.layers[0].keys.shape[1]
    for layer, attention in enumerate(attentions):
        assert cache.layers[layer].seen == length  # the request's columns are given back
        group = attention.shape[1] // kv_heads
        for head in range(kv_heads):
            mass = attention[0, head * group : (head + 1) * group, length:, :length].double().sum(dim=(0, 1))
            entries = kept(cache, layer, head)
            assert max(entries) < length and len(entries) == heavy + recent
            chosen = entries - set(range(length - recent, length))
            others = set(range(length - recent)) - chosen
            assert len(chosen) == heavy
            assert min(mass[i] for i in chosen) >= max(mass[i] for i in others) - 1e-6, (layer, head)
            lay = cache.layers[layer]
            scores = {int(p): float(s) for p, s in zip(lay.pos[0, head], lay.scores[0, head], strict=True)}
            for i in entries:
                assert scores[i] == pytest.approx(float(mass[i]), abs=1e-5)


@pytest.mark.filterwarnings("ignore::h2o_kv.hf.cache.H2OBudgetWarning")
def test_nothing_evicted_is_a_plain_prefill(llama):
    """With a budget holding the whole prompt the pass changes nothing: same logits, same greedy continuation."""
    ids = random_prompt(24, seed=5)
    plain = H2OCache(heavy=40, recent=40, policy="h2o")
    with torch.no_grad():
        plain_logits = llama(ids, **cache_kwargs(plain), use_cache=True).logits[:, -1]
    scored = H2OCache(heavy=40, recent=40, policy="h2o")
    logits = prefill(llama, scored, ids, request_for(ids))
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=1e-5)
    assert scored.stats()["seen_tokens"] == 24 and scored.kept_entries() == 24
    for cache in (plain, scored):
        cache.stepwise = True
    token, ref_token = logits.argmax(-1, keepdim=True), plain_logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(10):  # decode steps continue at column 24 in both (positions come from the cache)
            assert token.tolist() == ref_token.tolist()
            step = llama(token, **cache_kwargs(scored), use_cache=True).logits[:, -1]
            ref_step = llama(ref_token, **cache_kwargs(plain), use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, ref_step, atol=1e-4, rtol=1e-4)
            token, ref_token = step.argmax(-1, keepdim=True), ref_step.argmax(-1, keepdim=True)


def test_ratio_budget_is_of_the_prompt_not_the_pass(llama):
    ids = random_prompt(40, seed=2)
    cache = H2OCache(budget=0.4, policy="snapkv")
    prefill(llama, cache, ids, request_for(ids))
    assert (cache.heavy, cache.recent) == Budget.of(0.4).split(40) == (8, 8)
    assert cache.kept_entries() == 16 and cache.stats()["seen_tokens"] == 40


def test_scoring_pass_refusals(llama):
    ids = random_prompt(8, seed=1)
    for cache in (H2OCache(heavy=2, recent=2, stepwise=True), H2OCache(heavy=2, recent=2, kv_bits=8)):
        with pytest.raises(ValueError, match="a scoring pass needs a plain prompt chunk"):
            prefill(llama, cache, ids, request_for(ids))
    with pytest.raises(ValueError, match="rows must be an integer >= 1"):
        with H2OCache(heavy=2, recent=2).scoring_pass(0):
            pass
    with pytest.raises(ValueError, match=r"input_ids must be one prompt \[1, L\]"):
        prefill(llama, H2OCache(heavy=2, recent=2), ids.repeat(2, 1), request_for(ids))
    for name, bits in (("dynamic", None), ("full", None), ("h2o", 4)):
        budget = None if name in ("dynamic", "full") else Budget.of(0.2)
        with pytest.raises(ValueError, match="reconstruct: a context-reconstruction pass scores the prompt"):
            KVSetting(name, budget, bits, reconstruct="sum")
    with pytest.raises(ValueError, match="reconstruct must be one of sum, max; got 'mean'"):
        KVSetting.of("snapkv", budget=0.2, reconstruct="mean")
    setting = KVSetting.of("snapkv", budget=0.2, reconstruct="sum")
    assert setting.label == "snapkv+rec" and setting.fields()["reconstruct"] == "sum"
    assert KVSetting.of("snapkv", budget=0.2, reconstruct="max").label == "snapkv+recmax"
    assert "reconstruct" not in KVSetting.of("snapkv", budget=0.2).fields()  # earlier records still resume


def test_cli_refuses_reconstruct_with_a_press():
    from h2o_kv import cli

    for value, message in (("max", "--reconstruct scores the prompt for an h2o-kv --policy"),
                           ("mean", "--reconstruct must be one of sum, max; got 'mean'")):  # fmt: skip
        args = ["eval", "ruler", "--peer", "snapkv", "--reconstruct", value, "--budget", "0.2", "--n", "1"]
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_request_in_the_chat_template(default_model):
    _, tokenizer = default_model
    reconstruction = Reconstruction.for_tokenizer(tokenizer)
    text = tokenizer.decode(reconstruction.request)
    assert text.startswith(REQUEST) and text.endswith("<|im_start|>assistant\n"), text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "The code is 7."}], tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    rows = reconstruction.scoring_ids(ids)
    assert rows[: len(reconstruction.request)] == reconstruction.request
    assert tokenizer.decode(rows[len(reconstruction.request) :]).startswith("The code is 7.")
