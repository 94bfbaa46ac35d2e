"""kvpress presses as a peer: no compression == plain generation, a real budget shrinks the cache, positions stay
right after compression, and the budget maps to the same entry count as h2o-kv's cache."""

from __future__ import annotations

import math
import os

import pytest
import torch

from h2o_kv.eval.runner import KVRunner, score_continuations
from h2o_kv.eval.tasks import TasksJob
from h2o_kv.harness.peers import (
    DECODING_PRESSES,
    PRESSES,
    compression_ratio,
    kvpress_available,
    press_close,
    press_expand,
    press_extend,
    press_prefill,
    require_kvpress,
)
from h2o_kv.harness.setting import KVSetting

# kvpress is imported through require_kvpress only: it undoes kvpress' global patch of every attention function.
# The peer is optional, but where it must run (CI's kvpress job sets H2O_KV_REQUIRE_PEERS=1) a missing kvpress fails.
if not kvpress_available():
    if os.environ.get("H2O_KV_REQUIRE_PEERS") == "1":
        raise ImportError("H2O_KV_REQUIRE_PEERS=1 but kvpress is not installed: pip install 'h2o-kv[peers]'")
    pytest.skip("the kvpress peer is optional: pip install 'h2o-kv[peers]'", allow_module_level=True)


def press(name: str, **budget) -> KVSetting:
    return KVSetting.of(f"kvpress:{name}", **budget)


def no_compression(prompt, name) -> KVSetting:
    """A press that keeps every entry (compression_ratio 0): heavy = prompt length, recent = 0."""
    return press(name, heavy=len(prompt), recent=0)


@pytest.fixture(scope="module")
def prompt(default_model):
    _, tokenizer = default_model
    messages = [{"role": "user", "content": "Name three colours of the rainbow, then say which one you like best."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def test_budget_maps_to_the_h2o_entry_count():
    """The press keeps exactly the entries Budget gives an h2o-kv cache after the same prefill (clamped to 1 each)."""
    compute_n_kept = require_kvpress().utils.compute_n_kept
    for length in (7, 64, 100, 333, 1000, 4097):
        for budget in (0.05, 0.2, 0.5, 1.0):
            keep = press("tova", budget=budget).entries(length)
            assert keep == min(length, 2 * max(1, math.floor(budget * length / 2)))
            assert keep == KVSetting.of("h2o", budget=budget).entries(length)
            ratio = compression_ratio(length, keep)
            if keep < length:
                assert compute_n_kept(length, ratio) == keep  # kvpress keeps exactly what h2o-kv keeps
                assert abs(ratio - (1 - budget)) <= 2.5 / length
            else:
                assert ratio == 0.0
    assert press("snapkv", heavy=10, recent=5).entries(100) == 15


@pytest.mark.parametrize("name", [name for name in PRESSES if name not in DECODING_PRESSES])
def test_press_without_compression_generates_like_the_plain_model(default_model, prompt, name):
    model, tokenizer = default_model
    ids = torch.tensor([prompt])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    tokens, session = KVRunner(model, no_compression(prompt, name)).generate(prompt, 12)
    assert session.press_state.compression_ratio == 0.0 and session.kept == len(prompt)
    generated = plain[0, len(prompt) :].tolist()
    assert len(generated) >= 4 and tokens[: len(generated)] == generated
    assert model.config._attn_implementation == "h2o"  # ObservedAttention's eager switch was undone


@pytest.mark.parametrize("name", list(PRESSES))
def test_press_at_80_percent_shrinks_the_cache(default_model, prompt, name):
    model, _ = default_model
    expected = press(name, budget=0.2).entries(len(prompt))
    state = press_prefill(model, torch.tensor([prompt]), name, expected)
    assert state.kept == expected < len(prompt) // 4
    heads, spec = model.config.num_key_value_heads, PRESSES[name]
    dropped = heads * (len(prompt) - expected)  # masked entries per layer
    masked = [len(b.self_attn.masked_key_indices[0]) for b in model.model.layers] if spec.head_wise else []
    if spec.across_layers:  # KVzip: one budget for the whole model, kvpress' int() rounding within half an entry
        assert 0 <= len(masked) * dropped - sum(masked) <= len(masked) * heads / 2 and len(set(masked)) > 1
    elif spec.head_wise:  # entries stay, masked per head; each layer masks exactly its share
        assert masked == [dropped] * len(masked)
    for layer in state.cache.layers:  # PyramidKV's layer budgets fall back to SnapKV's below 6,400 tokens at 20%
        assert layer.keys.shape[2] == (len(prompt) if spec.head_wise else expected)
    logits = press_extend(model, state, torch.tensor([prompt[-3:]]))  # appends; a decoding press compresses back
    press_close(state)
    assert torch.isfinite(logits).all() and state.cache.get_seq_length() == state.cache.layers[0].keys.shape[2]
    grown = 0 if spec.decoding else 3
    assert state.cache.layers[0].keys.shape[2] == (len(prompt) if PRESSES[name].head_wise else expected) + grown
    assert state.next_position == len(prompt) + 3
    assert model.config._attn_implementation == "h2o"


def hooked(model) -> int:
    return sum(len(layer.self_attn._forward_hooks) for layer in model.model.layers)


@torch.no_grad()
@pytest.mark.parametrize("name", DECODING_PRESSES)
def test_decoding_press_keeps_the_budget_while_generating(default_model, prompt, name):
    """kvpress' ``DecodingPress`` (after its scorer compressed the prefill, exactly as the compress-once press of
    that scorer does) brings the cache back to the budget after every later forward, a decode step or a chunk;
    its hooks stay on until :func:`press_close` (or the end of ``KVRunner.generate``), then the model is plain."""
    model, _ = default_model
    scorer = name.removeprefix("decoding_")
    keep = press(name, budget=0.2).entries(len(prompt))
    once = press_prefill(model, torch.tensor([prompt]), scorer, keep)
    state = press_prefill(model, torch.tensor([prompt]), name, keep)
    assert hooked(model) > 0 and state.kept == once.kept == keep
    assert torch.equal(state.logits, once.logits)
    lengths = []
    try:
        for token in prompt[-6:]:  # decode steps
            press_extend(model, state, torch.tensor([[token]]))
            lengths.append(state.cache.get_seq_length())
        press_extend(model, state, torch.tensor([prompt[-9:]]))  # a question fed at once
        lengths.append(state.cache.get_seq_length())
    finally:
        press_close(state)
    assert lengths == [keep] * 7 and state.next_position == len(prompt) + 15
    assert hooked(model) == 0 and model.config._attn_implementation == "h2o"
    tokens, session = KVRunner(model, press(name, budget=0.2)).generate(prompt, 8)
    assert len(tokens) == 8 and session.cache.get_seq_length() == keep and hooked(model) == 0
    with pytest.raises(ValueError, match=f"--peer {name} compresses while generating"):
        TasksJob.create("piqa", press(name, budget=0.2))


@torch.no_grad()
@pytest.mark.parametrize("name", ["adakv_expected_attention", "snapkv"])
def test_masked_entries_are_not_attended_and_follow_batch_copies(default_model, prompt, name):
    """After ``press_expand`` every copy of the batch sees the compressed context as the single sequence does (a
    head-wise press's mask is copied with the cache), and the mask does change what later queries attend."""
    model, _ = default_model
    keep = press(name, budget=0.2).entries(len(prompt))
    continuation = torch.tensor([[11, 22, 33]])
    state = press_prefill(model, torch.tensor([prompt]), name, keep)
    alone = press_extend(model, state, continuation)
    again = press_prefill(model, torch.tensor([prompt]), name, keep)
    press_expand(model, again, 3)
    batched = press_extend(model, again, continuation.expand(3, -1))
    for copy in range(3):
        torch.testing.assert_close(batched[copy], alone[0], atol=2e-4, rtol=1e-4)
    full = press_prefill(model, torch.tensor([prompt]), name, len(prompt))
    plain = press_extend(model, full, continuation)
    assert not torch.allclose(alone, plain, atol=1e-2)  # the mask (or the removal) changed what was attended


@torch.no_grad()
def test_positions_continue_after_compression(default_model, prompt):
    """With nothing removed, extending after a press equals running prompt + continuation in one pass."""
    model, _ = default_model
    continuation = [11, 22, 33, 44]
    state = press_prefill(model, torch.tensor([prompt]), "knorm", len(prompt))
    assert state.compression_ratio == 0.0 and state.kept == len(prompt)
    logits = press_extend(model, state, torch.tensor([continuation]))
    whole = model(torch.tensor([prompt + continuation])).logits[:, len(prompt) :]
    torch.testing.assert_close(logits, whole, atol=2e-4, rtol=1e-4)


def test_peer_runs_through_the_task_scorer(default_model, prompt):
    model, _ = default_model
    choices = [[1234, 567], [89], [4321, 765, 43]]
    full, _ = score_continuations(KVRunner(model, KVSetting("dynamic")), prompt, choices)
    same, session = score_continuations(KVRunner(model, no_compression(prompt, "snapkv")), prompt, choices)
    assert [s[0] for s in same] == pytest.approx([f[0] for f in full], abs=2e-3)
    squeezed, session = score_continuations(KVRunner(model, press("tova", budget=0.2)), prompt, choices)
    assert session.kept == KVSetting.of("h2o", budget=0.2).entries(len(prompt))
    assert squeezed[1][0] == pytest.approx(full[1][0], abs=2e-3)  # one-token answers come from the full prefill
    assert squeezed[2][0] != pytest.approx(full[2][0], abs=1e-3)  # later tokens see the compressed cache


def test_kvpress_import_leaves_other_attention_functions_alone():
    """kvpress' head-wise attention patch stays on sdpa only (where the presses run); h2o-kv's function is its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    require_kvpress()
    patched = {n for n, f in ALL_ATTENTION_FUNCTIONS.items() if "attention_patch" in getattr(f, "__qualname__", "")}
    assert patched <= {"sdpa"} and "h2o" in ALL_ATTENTION_FUNCTIONS
