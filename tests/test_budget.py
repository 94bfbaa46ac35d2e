"""The budget rule (h2o_kv.Budget): the paper's ratio, and the ``min_entries`` floor under it (issue 26 item 1)."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt
from reference import reference_generate

from h2o_kv import Budget, H2OCache, load_model


@pytest.mark.parametrize(
    "budget, length, split",
    [
        (Budget(ratio=0.2), 38, (3, 3)),  # the paper's rule: what garbled a short chat in the server
        (Budget(ratio=0.2, min_entries=256), 38, (128, 128)),  # the floor
        (Budget(ratio=0.2, min_entries=255), 38, (128, 127)),  # an odd floor: heavy takes the extra entry
        (Budget(ratio=0.2, min_entries=256), 1280, (128, 128)),  # where the ratio meets the floor
        (Budget(ratio=0.2, min_entries=256), 2000, (200, 200)),  # above it the ratio applies
        (Budget(ratio=0.2, min_entries=0), 38, (3, 3)),  # 0: no floor
        (Budget(heavy=8, recent=4), 38, (8, 4)),  # counts are the budget
    ],
)
def test_split_with_and_without_the_floor(budget, length, split):
    assert budget.split(length) == split
    assert budget.entries(length) == min(length, sum(split))
    assert budget.floored(length) == (budget.is_ratio and split != Budget(ratio=budget.ratio).split(length))
    assert Budget(ratio=0.2).floored(length) is False


def test_floor_of_a_short_prompt_and_where_it_stops():
    budget = Budget.of(0.2, min_entries=256)
    assert budget.floored(38) and budget.floored(1279) and not budget.floored(1280)
    assert budget.describe() == "budget=0.2, min_entries=256"
    assert Budget.of(0.2).describe() == "budget=0.2"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(heavy=8, recent=8, min_entries=64), "min_entries is a floor under a ratio budget"),
        (dict(ratio=0.2, min_entries=-1), "min_entries must be an integer >= 0"),
        (dict(ratio=0.2, min_entries=1.5), "min_entries must be an integer >= 0"),
        (dict(ratio=0.2, min_entries=True), "min_entries must be an integer >= 0"),
    ],
)
def test_bad_floors_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def test_transformers_backend_keeps_the_paper_rule_by_default_and_takes_the_floor(llama):
    """``H2OCache(budget=...)`` is the paper's rule; ``min_entries`` (a pass-through to Budget) makes a short
    prompt plus its reply run exactly as the full cache, and a long one evict as a count budget of the floor."""
    ids = random_prompt(30)
    plain = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, pad_token_id=0)  # fmt: skip
    paper = H2OCache(budget=0.2)
    tokens, _ = greedy_generate(llama, ids, paper, 20)
    assert (paper.heavy, paper.recent) == (3, 3) and paper.stats()["evicted_tokens"] > 0
    with pytest.warns(UserWarning, match="nothing is evicted"):
        floored = H2OCache(budget=0.2, min_entries=64)
        tokens, _ = greedy_generate(llama, ids, floored, 20)
    assert torch.equal(tokens, plain[:, 30:])
    assert (floored.heavy, floored.recent) == (32, 32) and floored.stats()["evicted_tokens"] == 0
    long = random_prompt(80)  # 80 tokens > 32 + 32: the floor is a budget like heavy=recent=32
    cache = H2OCache(budget=0.2, min_entries=64)
    tokens, _ = greedy_generate(llama, long, cache, 20)
    assert tokens[0].tolist() == reference_generate(llama, long, 20, heavy=32, recent=32)[0][0]
    assert cache.stats()["evicted_tokens"] > 0


def test_floor_needs_a_ratio_in_the_cache_too():
    with pytest.raises(ValueError, match="min_entries is a floor"):
        H2OCache(heavy=8, recent=8, min_entries=64)
    with pytest.raises(ValueError, match="keeps every entry"):
        H2OCache(policy="full", min_entries=64)
