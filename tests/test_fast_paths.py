"""The shortcuts of the hot paths give the results of the general paths.

* ``attention_with_mass(key_valid=None)`` (no padding, no free slot: only the causal triangle is masked) equals
  the general mask built from positions and validity; cache-sized score blocks (written into one reused buffer)
  equal one big block.
* The fused H2O ranking of ``kernels/cpu/decode_step.cpp`` (``h2o_victim``) is the Python specification
  (:class:`h2o_kv.policies.H2O`'s hooks composed by :meth:`Policy.decode_victim`), ties and all-recent rows included;
  ``tests/serving/test_paged_decode.py`` checks ``kernels/cpu/paged_decode.cpp`` against the same composition.
* A decode step in the bounded steady state (``H2OLayer._free`` / ``H2OLayer.full``: the free slot is the last
  victim, no counts, no mask, the victim's validity flag cleared lazily) produces what the general step (free-slot
  search, counts, masking) produces.
"""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt

from h2o_kv import H2OCache, kernels, load_model
from h2o_kv.hf import attention as hf_attention
from h2o_kv.hf.cache import H2OLayer
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.policies import H2O, EntryView, Policy


def _inputs(kept: int, rows: int, batch: int = 2, q_heads: int = 6, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    """A prompt chunk of ``rows`` rows after ``kept`` kept entries (at earlier columns, in any order)."""
    g = torch.Generator().manual_seed(seed)
    entries, first = kept + rows, 50
    query = torch.randn(batch, rows, q_heads, dim, generator=g).transpose(1, 2)  # as the attention modules pass it
    keys = torch.randn(batch, kv_heads, entries, dim, generator=g)
    values = torch.randn(batch, kv_heads, entries, dim, generator=g)
    old = torch.randperm(first, generator=g)[:kept].expand(batch, kv_heads, kept)
    pos = torch.cat([old, torch.arange(first, first + rows).expand(batch, kv_heads, rows)], dim=2)
    return query, keys, values, pos, first


@pytest.mark.parametrize("kept", [0, 9])
@pytest.mark.parametrize("window", [1, 5])
def test_unmasked_chunk_and_small_blocks_equal_the_general_path(kept, window):
    query, keys, values, pos, first = _inputs(kept, 40)
    valid = torch.ones_like(pos, dtype=torch.bool)
    args = (query, keys, values, pos)
    general = hf_attention.attention_with_mass(*args, valid, first, 0.3, window=window, chunk_start=kept)
    fast = hf_attention.attention_with_mass(*args, None, first, 0.3, window=window, chunk_start=kept)
    small = 150 * 8 * 2 * 6  # 150 scores per row block and query head: 3 to 8 rows, more where fewer keys are seen
    blocks = hf_attention.attention_with_mass(
        *args, None, first, 0.3, window=window, chunk_start=kept, chunk_bytes=small
    )
    no_skip = hf_attention.attention_with_mass(*args, valid, first, 0.3, window=window, chunk_bytes=small)  # all keys
    for other in (fast, blocks, no_skip):
        for a, b in zip(general, other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_padded_rows_add_no_mass_in_small_blocks():
    query, keys, values, pos, first = _inputs(0, 30)
    valid = torch.ones_like(pos, dtype=torch.bool)
    valid[0, :, :7] = False  # left padding of sequence 0
    real = torch.ones(2, 30, dtype=torch.bool)
    real[0, :7] = False
    whole = hf_attention.attention_with_mass(
        query, keys, values, pos, valid, first, 0.3, query_valid=real, chunk_start=0
    )
    small = hf_attention.attention_with_mass(
        query, keys, values, pos, valid, first, 0.3, query_valid=real, chunk_start=0, chunk_bytes=100 * 8 * 2 * 6
    )
    for a, b in zip(whole[:2], small[:2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert whole[1][0, :, :7].abs().max() == 0  # pads receive nothing
    alone = hf_attention.attention_with_mass(  # sequence 0 without its pads
        query[:1, :, 7:], keys[:1, :, 7:], values[:1, :, 7:], pos[:1, :, 7:], None, first + 7, 0.3, chunk_start=0
    )
    torch.testing.assert_close(whole[0][0, 7:], alone[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole[1][0, :, 7:], alone[1][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_fused_h2o_victim_is_the_python_specification(seed):
    """The C++ kernel against H2O's hooks (not the kernel's own restatement): same scores, same victims."""
    ops = kernels.cpu_ops(torch.zeros(1))
    if ops is None:
        pytest.skip("the fused CPU kernels are unavailable (no compiler, or H2O_KV_FUSED=0)")
    g = torch.Generator().manual_seed(seed)
    batch, heads, slots, recent = 2, 3, 24, 6
    scores = torch.randint(0, 3, (batch, heads, slots), generator=g).float()  # many ties
    mass = torch.randint(0, 3, (batch, heads, slots), generator=g).float() / 4
    pos = torch.stack([torch.randperm(40, generator=g)[:slots] for _ in range(batch * heads)]).view(batch, heads, -1)
    pos[1, 2] = torch.arange(40 - slots, 40)  # a row whose entries are all in the recent window
    seen = 40 - slots + recent if seed % 2 else 40  # seed 1, 3: every entry recent in that row only
    policy = H2O(heavy=slots - recent - 1, recent=recent)
    view = EntryView(pos, torch.ones_like(pos, dtype=torch.bool), scores.clone(), seen, torch.zeros(batch).long())
    want_scores, want = Policy.decode_victim(policy, view, mass, mass)  # the composition of the hooks
    got = ops.h2o_victim(scores, mass, pos, seen - recent)
    assert torch.equal(scores, want_scores) and torch.equal(got, want)


def _without_fast_path(monkeypatch):
    """Make every decode step take the general path (the steady-state hints are never set)."""
    append, evict = H2OLayer.append, H2OLayer.evict

    def general_append(self, *args):
        self._free = None
        append(self, *args)
        self.full = False

    def general_evict(self, *args):
        evict(self, *args)
        self._free = None

    monkeypatch.setattr(H2OLayer, "append", general_append)
    monkeypatch.setattr(H2OLayer, "evict", general_evict)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


@pytest.mark.parametrize("policy", ["h2o", "tova", "sink"])
def test_steady_state_decode_equals_the_general_step(llama, policy, monkeypatch):
    ids = random_prompt(40, batch=2)
    fast_cache = H2OCache(heavy=6, recent=8, policy=policy)
    seen = {"fast": 0}
    original = H2OLayer.evict

    def counting(self, *args):
        seen["fast"] += bool(self.full)
        original(self, *args)

    monkeypatch.setattr(H2OLayer, "evict", counting)
    fast, fast_logits = greedy_generate(llama, ids, fast_cache, 20)
    assert seen["fast"] > 0  # the steady state was reached
    monkeypatch.undo()
    _without_fast_path(monkeypatch)
    slow_cache = H2OCache(heavy=6, recent=8, policy=policy)
    slow, slow_logits = greedy_generate(llama, ids, slow_cache, 20)
    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(fast_cache.layers, slow_cache.layers, strict=True):
        assert torch.equal(a.valid, b.valid) and torch.equal(a.pos, b.pos) and torch.equal(a.scores, b.scores)
    assert fast_cache.stats()["kv_tokens"] == 14


def test_stepwise_padding_leaves_the_fast_path(llama, monkeypatch):
    """A pad token written in a stepwise chunk leaves a free slot behind: the fast path must not assume none."""

    def run():
        cache = H2OCache(heavy=4, recent=4, stepwise=True)
        mask = torch.ones(1, 36, dtype=torch.long)
        mask[0, 31] = mask[0, 33] = 0  # pad tokens inside the second chunk
        with torch.no_grad():
            first = llama(random_prompt(30), **cache_kwargs(cache)).logits
            second = llama(random_prompt(6, seed=5), attention_mask=mask, **cache_kwargs(cache)).logits
        assert all(int(layer.entry_count().max()) == 8 for layer in cache.layers)
        return torch.cat([first, second], dim=1)

    fast = run()
    _without_fast_path(monkeypatch)
    torch.testing.assert_close(fast, run(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["sink", "random"])
def test_prompt_without_padding_mask_records_the_start(llama, policy):
    """A prompt run without an attention mask (as ``h2o-kv bench`` does) keeps what the masked run keeps: the
    sequences start at column 0 (``sink`` keeps the first tokens, ``random`` keys are relative to the start)."""
    ids = random_prompt(40)
    kept = []
    for mask in (None, torch.ones_like(ids)):
        cache = H2OCache(heavy=4, recent=4, policy=policy)
        with torch.no_grad():
            llama(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        assert cache.layers[0].start.tolist() == [0]
        kept.append([lay.pos[0, h][lay.valid[0, h]].sort().values.tolist() for lay in cache.layers for h in (0, 1)])
    assert kept[0] == kept[1]
    if policy == "sink":
        assert kept[0][0][:4] == [0, 1, 2, 3]
