"""kvpress presses as a peer: no compression == plain generation, a real budget shrinks the cache, positions stay
right after compression, and the budget maps to the same entry count as h2o-kv's cache."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_kv.eval.tasks import KVRunner, KVSpec
from h2o_kv.peers import (
    PRESSES,
    compression_ratio,
    kept_entries,
    kvpress_available,
    press_extend,
    press_prefill,
    require_kvpress,
)

# kvpress is imported through require_kvpress only: it undoes kvpress' global patch of every attention function
pytestmark = pytest.mark.skipif(
    not kvpress_available(), reason="the kvpress peer is optional: pip install 'h2o-kv[peers]'"
)


def no_compression(prompt, press) -> KVSpec:
    """A press that keeps every entry (compression_ratio 0): heavy = prompt length, recent = 0."""
    return KVSpec(None, heavy=len(prompt), recent=0, peer=press)


@pytest.fixture(scope="module")
def prompt(default_model):
    _, tokenizer = default_model
    messages = [{"role": "user", "content": "Name three colours of the rainbow, then say which one you like best."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def test_budget_maps_to_the_h2o_entry_count():
    compute_n_kept = require_kvpress().utils.compute_n_kept
    for length in (7, 64, 100, 333, 1000, 4097):
        for budget in (0.05, 0.2, 0.5, 1.0):
            keep = kept_entries(length, budget=budget)
            assert keep == min(length, 2 * max(1, math.floor(budget * length / 2)))
            ratio = compression_ratio(length, keep)
            if keep < length:
                assert compute_n_kept(length, ratio) == keep  # kvpress keeps exactly what h2o-kv keeps
                assert abs(ratio - (1 - budget)) <= 2.5 / length
            else:
                assert ratio == 0.0
    assert kept_entries(100, heavy=10, recent=5) == 15


@pytest.mark.parametrize("press", list(PRESSES))
def test_press_without_compression_generates_like_the_plain_model(default_model, prompt, press):
    model, tokenizer = default_model
    ids = torch.tensor([prompt])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    tokens, session = KVRunner(model, no_compression(prompt, press)).generate(prompt, 12)
    assert session.press_state.compression_ratio == 0.0 and session.kept == len(prompt)
    generated = plain[0, len(prompt) :].tolist()
    assert len(generated) >= 4 and tokens[: len(generated)] == generated
    assert model.config._attn_implementation == "h2o"  # ObservedAttention's eager switch was undone


@pytest.mark.parametrize("press", list(PRESSES))
def test_press_at_80_percent_shrinks_the_cache(default_model, prompt, press):
    model, _ = default_model
    state = press_prefill(model, torch.tensor([prompt]), press, budget=0.2)
    expected = kept_entries(len(prompt), budget=0.2)
    assert state.kept == expected < len(prompt) // 4
    assert all(layer.keys.shape[2] == expected for layer in state.cache.layers)
    logits = press_extend(model, state, torch.tensor([prompt[-3:]]))  # decoding appends, never evicts
    assert torch.isfinite(logits).all() and state.cache.get_seq_length() == expected + 3
    assert state.next_position == len(prompt) + 3


@torch.no_grad()
def test_positions_continue_after_compression(default_model, prompt):
    """With nothing removed, extending after a press equals running prompt + continuation in one pass."""
    model, _ = default_model
    continuation = [11, 22, 33, 44]
    state = press_prefill(model, torch.tensor([prompt]), "knorm", heavy=len(prompt), recent=0)
    assert state.compression_ratio == 0.0 and state.kept == len(prompt)
    logits = press_extend(model, state, torch.tensor([continuation]))
    whole = model(torch.tensor([prompt + continuation])).logits[:, len(prompt) :]
    torch.testing.assert_close(logits, whole, atol=2e-4, rtol=1e-4)


def test_peer_runs_through_the_task_scorer(default_model, prompt):
    from h2o_kv.eval.tasks import score_continuations

    model, _ = default_model
    choices = [[1234, 567], [89], [4321, 765, 43]]
    full, _ = score_continuations(KVRunner(model, KVSpec("full")), prompt, choices)
    same, session = score_continuations(KVRunner(model, no_compression(prompt, "snapkv")), prompt, choices)
    assert [s[0] for s in same] == pytest.approx([f[0] for f in full], abs=2e-3)
    squeezed, session = score_continuations(KVRunner(model, KVSpec(None, budget=0.2, peer="tova")), prompt, choices)
    assert session.kept == kept_entries(len(prompt), budget=0.2)
    assert squeezed[1][0] == pytest.approx(full[1][0], abs=2e-3)  # one-token answers come from the full prefill
    assert squeezed[2][0] != pytest.approx(full[2][0], abs=1e-3)  # later tokens see the compressed cache


def test_kvpress_import_leaves_other_attention_functions_alone():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    require_kvpress()
    assert not any("attention_patch" in getattr(f, "__qualname__", "") for f in ALL_ATTENTION_FUNCTIONS.values())
