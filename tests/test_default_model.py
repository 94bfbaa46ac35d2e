"""The real default model (SmolLM2-135M-Instruct, GQA 9/3 heads) under H2O, against the reference."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate
from reference import reference_generate

from h2o_kv import H2OCache

QUESTION = "Summarise in one sentence why the sky looks blue during the day but red at sunset."


@pytest.fixture(scope="module")
def chat_ids(default_model):
    _, tokenizer = default_model
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.mark.slow
def test_default_model_matches_reference(default_model, chat_ids):
    model, _ = default_model
    expected, expected_logits = reference_generate(model, chat_ids, 24, heavy=8, recent=8)
    cache = H2OCache(heavy=8, recent=8)
    tokens, logits = greedy_generate(model, chat_ids, cache, 24, pad_token_id=None)
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0], expected_logits, atol=2e-3, rtol=1e-3)
    stats = cache.stats()
    assert stats["kv_tokens"] == 16 and stats["layers"] == 30 and stats["evicted_tokens"] > 0


@pytest.mark.slow
def test_default_model_full_budget_equals_plain_generate(default_model, chat_ids):
    model, tokenizer = default_model
    plain = model.generate(
        chat_ids, attention_mask=torch.ones_like(chat_ids), max_new_tokens=24, min_new_tokens=24, do_sample=False
    )[0, chat_ids.shape[1] :].tolist()
    with pytest.warns(UserWarning, match="nothing is evicted"):
        tokens = greedy_generate(model, chat_ids, H2OCache(heavy=512, recent=512), 24, pad_token_id=None)[0][0].tolist()
    assert tokens == plain
    assert "blue" in tokenizer.decode(tokens).lower() or "scatter" in tokenizer.decode(tokens).lower()
