"""The real default model (SmolLM2-135M-Instruct, GQA 9/3 heads) under H2O, against the reference."""

from __future__ import annotations

import pytest
import torch
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


def generate(model, ids, cache, new_tokens):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.logits)[:, 0]


def test_default_model_matches_reference(default_model, chat_ids):
    model, _ = default_model
    expected, expected_logits = reference_generate(model, chat_ids, 24, heavy=8, recent=8)
    cache = H2OCache(heavy=8, recent=8)
    tokens, logits = generate(model, chat_ids, cache, 24)
    assert tokens == expected[0]
    torch.testing.assert_close(logits, expected_logits, atol=2e-3, rtol=1e-3)
    stats = cache.stats()
    assert stats["kv_tokens"] == 16 and stats["layers"] == 30 and stats["evicted_tokens"] > 0


def test_default_model_full_budget_equals_plain_generate(default_model, chat_ids):
    model, tokenizer = default_model
    plain = model.generate(
        chat_ids, attention_mask=torch.ones_like(chat_ids), max_new_tokens=24, min_new_tokens=24, do_sample=False
    )[0, chat_ids.shape[1] :].tolist()
    with pytest.warns(UserWarning, match="nothing is evicted"):
        tokens, _ = generate(model, chat_ids, H2OCache(heavy=512, recent=512), 24)
    assert tokens == plain
    assert "blue" in tokenizer.decode(tokens).lower() or "scatter" in tokenizer.decode(tokens).lower()
