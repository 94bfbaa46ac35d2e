"""The fused CPU decode kernels (``h2o_kv.kernels``) give exactly what the torch ops they replace give."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from helpers import greedy_generate, random_prompt

from h2o_kv import H2OCache, kernels, load_model


@pytest.fixture(scope="module")
def ops():
    """The compiled kernels (built on first use, about 30 s once per machine: here, not at test collection)."""
    built = kernels.cpu_ops(torch.zeros(1))
    if built is None:
        pytest.skip("fused kernels unavailable (no compiler or H2O_KV_FUSED=0)")
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_slot_equals_scatter(ops, dtype):
    g = torch.Generator().manual_seed(0)
    batch, heads, slots, dim = 3, 2, 11, 8
    keys, values = (torch.randn(batch, heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    pos, scores = torch.randint(0, 99, (batch, heads, slots), generator=g), torch.rand(batch, heads, slots, generator=g)
    key, value = (torch.randn(batch, heads, 1, dim, generator=g).to(dtype) for _ in range(2))
    valid = torch.rand(batch, heads, slots, generator=g) > 0.5
    free = torch.randint(0, slots, (batch, heads, 1), generator=g)
    want = [t.clone() for t in (keys, values, pos, scores, valid)]
    for buffer, new in zip(want[:2], (key, value), strict=True):
        buffer.scatter_(2, free.unsqueeze(-1).expand(-1, -1, -1, dim), new)
    want[2].scatter_(2, free, 123)
    want[3].scatter_(2, free, 0.0)
    want[4].scatter_(2, free, True)
    ops.write_slot(keys, values, pos, scores, valid, free, key, value, 123)
    for got, expected in zip((keys, values, pos, scores, valid), want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_h2o_victim_equals_mask_and_min(ops, seed):
    """Scores += mass in place, then the first lowest score outside the recent window (ties included)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, slots = 2, 3, 40
    scores = torch.randint(0, 4, (batch, heads, slots), generator=g).float()  # many ties
    mass = torch.randint(0, 3, (batch, heads, slots), generator=g).float() / 4
    pos = torch.stack([torch.randperm(60, generator=g)[:slots] for _ in range(batch * heads)]).view(batch, heads, -1)
    want_scores = scores + mass
    want = want_scores.masked_fill(pos >= 45, math.inf).min(-1, keepdim=True).indices
    got = ops.h2o_victim(scores, mass, pos, 45)
    assert torch.equal(scores, want_scores) and torch.equal(got, want)


def test_kernels_check_their_inputs(ops):
    scores = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="h2o_victim: scores/mass must be contiguous float32"):
        ops.h2o_victim(scores, torch.zeros(1, 1, 4, dtype=torch.float64), torch.zeros(1, 1, 4, dtype=torch.long), 1)
    keys, pos, valid = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, 4).bool()
    with pytest.raises(RuntimeError, match="slot index out of range"):
        ops.write_slot(keys, keys.clone(), pos, scores, valid, torch.tensor([[[4]]]), torch.zeros(1, 1, 1, 2),
                       torch.zeros(1, 1, 1, 2), 0)  # fmt: skip
    with pytest.raises(RuntimeError, match="valid must be a contiguous bool tensor"):
        ops.write_slot(keys, keys.clone(), pos, scores, valid.byte(), torch.tensor([[[0]]]), torch.zeros(1, 1, 1, 2),
                       torch.zeros(1, 1, 1, 2), 0)  # fmt: skip


def test_kernels_skip_what_they_do_not_handle():
    assert kernels.cpu_ops(torch.zeros(4, 4).t()) is None  # not contiguous: the torch ops run


@pytest.mark.parametrize("policy", ["h2o", "h2o_mean"])
def test_generation_with_and_without_kernels_is_identical(ops, tiny_models, policy, monkeypatch):
    """Batch 2 with left padding, past the point where the steady state is reached: same tokens, same logits."""
    model = load_model(tiny_models["llama"], device="cpu")[0]
    ids = random_prompt(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def run():
        return greedy_generate(model, ids, H2OCache(heavy=6, recent=8, policy=policy), 24, attention_mask=mask)

    calls = {"write_slot": 0, "h2o_victim": 0}
    real_ops = kernels.cpu_ops

    class Counting:
        def __getattr__(self, name):
            calls[name] += 1
            return getattr(ops, name)

    monkeypatch.setattr(kernels, "cpu_ops", lambda *tensors: None if real_ops(*tensors) is None else Counting())
    fused = run()
    assert calls["write_slot"] > 0 and (calls["h2o_victim"] > 0) == (policy == "h2o")  # the kernels did run
    monkeypatch.setattr(kernels, "cpu_ops", lambda *tensors: None)
    plain = run()
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


def test_build_failure_warns_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension

    def broken(**kwargs):
        raise OSError("no compiler here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.setattr(kernels, "_loaded", {})
    with pytest.warns(UserWarning, match="could not be built .*no compiler here.*falls back to torch ops"):
        assert kernels.cpu_ops(torch.zeros(1)) is None
    assert kernels.cpu_ops(torch.zeros(1)) is None  # warned once, remembered
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("H2O_KV_FUSED", "0")
    assert kernels.cpu_ops(torch.zeros(1)) is None and kernels._loaded == {kernels._SOURCE: None}


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """A process killed mid-build leaves torch's lock file; a later build would wait for it forever."""
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(lock)
    assert lock.exists()  # a build may be running
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(lock)
    assert not lock.exists() and "stale kernel build lock" in capsys.readouterr().err
    kernels._clear_stale_lock(lock)  # none: nothing to do


def test_each_build_key_builds_once_into_its_own_directory(tmp_path, monkeypatch, capsys):
    """Another compiler or torch install is another directory (each builds once); the same key reuses its build."""
    import torch.utils.cpp_extension

    source = kernels._PAGED_SOURCE
    monkeypatch.setenv("H2O_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    built = []

    def compile_nothing(name, sources, build_directory, **flags):  # what a finished build leaves: the module file
        built.append(build_directory)
        (tmp_path / build_directory / f"{name}.so").touch()
        return name

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_nothing)
    key = kernels.build_key(source)
    assert key["torch"] == f"{torch.__version__} at {os.path.dirname(torch.__file__)}"
    assert "-march=native" in key["flags"] and key["compiler"].startswith("c++: ") and key["cpu"]
    assert kernels.build_key(source) == key and kernels.build_dir(source) == kernels.build_dir(source, key)
    assert kernels.build_dir(source, dict(key, torch="2.13.0 at /another/venv/torch")) != kernels.build_dir(source)

    first = kernels._build(source)
    err = capsys.readouterr().err
    assert "building the paged_decode kernel (no earlier build of it in this cache; about 110 s" in err
    assert kernels._build(source) == first and capsys.readouterr().err == ""  # same key: reused, silently
    monkeypatch.setenv("CXX", "g++-0-none")  # another environment's compiler (it need not run: load is faked)
    assert kernels.build_key(source)["compiler"] == "g++-0-none: not found"
    second = kernels._build(source)
    err = capsys.readouterr().err
    assert second != first and f"new build key: compiler changed since {kernels.build_dir(source, key).name}" in err
    assert len(set(built)) == 2 and "built the paged_decode kernel in" in err
