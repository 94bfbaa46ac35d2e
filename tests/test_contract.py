"""The per-step contract as documented (:mod:`h2o_kv.hf.cache`): the attention function uses exactly the layer
members of ``ATTENTION_CONTRACT`` and the fields of :class:`~h2o_kv.hf.cache.Step`, recorded on real forwards."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import greedy_generate, random_prompt

from h2o_kv import H2OCache, load_model
from h2o_kv.hf import attention as hf_attention
from h2o_kv.hf import cache as cache_module
from h2o_kv.hf.cache import ATTENTION_CONTRACT, Step
from h2o_kv.policies import H2O, POLICIES, make_policy
from h2o_kv.policies.base import BACKEND_CONTRACT


class Recorder:
    """Forwards every attribute to ``target`` and records its name in ``seen``."""

    def __init__(self, target, seen: set[str]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name):
        self._seen.add(name)
        return getattr(self._target, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"the attention function set {name!r} on {type(self._target).__name__}")


class LayerRecorder(Recorder):
    """A layer whose steps are recorded too (and unwrapped when given back)."""

    def __init__(self, layer, seen: set[str], step_seen: set[str]):
        super().__init__(layer, seen)
        object.__setattr__(self, "_step_seen", step_seen)

    def __getattr__(self, name):
        value = super().__getattr__(name)
        if name == "steps":
            return lambda *args: (Recorder(step, self._step_seen) for step in value(*args))
        if name == "observe":
            return lambda step, *args: value(step._target, *args)
        return value


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"], device="cpu")[0]


def _recorded(monkeypatch):
    layer_seen, step_seen = set(), set()
    take = hf_attention.staged_layer

    def recording(key):
        layer = take(key)
        return None if layer is None else LayerRecorder(layer, layer_seen, step_seen)

    monkeypatch.setattr(hf_attention, "staged_layer", recording)
    return layer_seen, step_seen


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"stepwise": True},
        {"streaming": True},
        {"kv_bits": 8, "kv_group_size": 8, "kv_residual": 2},
        {"streaming": True, "kv_bits": 4, "kv_group_size": 8, "kv_residual": 2},
    ],
)
def test_attention_uses_only_the_documented_members(llama, options, monkeypatch):
    """A prompt chunk, decode steps and (stepwise) a multi-token chunk, with a padded batch: the members used are the
    documented ones, and the outputs are those of the unrecorded run."""
    ids = random_prompt(24, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the general masks are exercised too
    plain = greedy_generate(llama, ids, H2OCache(heavy=4, recent=4, **options), 6, attention_mask=mask)
    layer_seen, step_seen = _recorded(monkeypatch)
    recorded = greedy_generate(llama, ids, H2OCache(heavy=4, recent=4, **options), 6, attention_mask=mask)
    assert torch.equal(plain[0], recorded[0])
    streaming = {"streaming", "roller"} if options.get("streaming") else {"streaming"}
    assert layer_seen == (ATTENTION_CONTRACT - {"roller"}) | streaming
    fields = {field.name for field in dataclasses.fields(Step)} - {"candidates"}  # candidates: for observe() only
    assert (
        step_seen <= fields | {"is_prompt"}
        and {"keys", "values", "pos", "valid", "all_valid", "first_column"} <= step_seen
    )


def test_the_union_of_all_modes_is_the_documented_contract(llama, monkeypatch):
    layer_seen, step_seen = _recorded(monkeypatch)
    ids = random_prompt(20)
    for options in ({}, {"streaming": True}, {"kv_bits": 4, "kv_group_size": 8, "kv_residual": 2}):
        greedy_generate(llama, ids, H2OCache(heavy=4, recent=4, **options), 4)
    assert layer_seen == ATTENTION_CONTRACT
    assert step_seen == {field.name for field in dataclasses.fields(Step)} - {"candidates"} | {"is_prompt"}


def test_no_thread_local_hand_off():
    assert not any(type(value).__name__ == "_local" for value in vars(cache_module).values())


def test_fused_ranking_is_one_property_of_the_policy():
    """Exactly the policies whose decode ranking is H2O's (the specification) may run the fused kernels."""
    fused = {name for name, cls in POLICIES.items() if make_policy(name, 2, 2).fused_h2o_ranking}
    assert fused == {"h2o", "ada_h2o", "global_h2o"}
    assert make_policy("a2sf", 2, 2, decay=1).fused_h2o_ranking  # decay 1 is exactly H2O
    assert not make_policy("a2sf", 2, 2, decay=0.9).fused_h2o_ranking

    @dataclasses.dataclass
    class Other(H2O):
        def keep_score(self, entries):
            return entries.scores

    assert not Other(2, 2).fused_h2o_ranking


def policy_members_used(folder: str) -> set[str]:
    """Attributes read of anything named ``policy`` (``self.policy.x``, ``row.entries.policy.x``, ``policy.x``) in
    the backend's sources: the static counterpart of the recorded runs above, so it covers the vLLM backend without
    vLLM installed."""
    found = set()
    for path in (Path(cache_module.__file__).parents[1] / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value).rpartition(".")[2] == "policy":
                found.add(node.attr)
    return found


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_backends_use_only_the_policy_contract(backend):
    used = policy_members_used(backend)
    assert {"accumulate", "keep_score", "capacity"} <= used  # the scan sees the backend's policy calls
    assert used <= BACKEND_CONTRACT, f"{backend} uses {sorted(used - BACKEND_CONTRACT)} beyond the contract"
