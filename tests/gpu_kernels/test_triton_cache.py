"""``H2OCache`` on CUDA: :func:`h2o_kv.kernels.step_ops` hands the cache the Triton kernels, and generation with
them matches the slow reference (``tests/reference.py``). Without a GPU the dispatch is pointed at the CPU tensors
(``_device_type``) so the same kernels run under the interpreter."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_generate, random_prompt
from reference import reference_generate, reference_logits
from transformers import AutoModelForCausalLM

from h2o_kv import H2OCache, enable_h2o, kernels
from h2o_kv.hf.compat import cache_kwargs

from .interpreter import INTERPRET, require_triton

require_triton()

from h2o_kv.kernels.triton import slots  # noqa: E402

# bf16 against the fp32 reference, teacher-forced (the same tokens in both): the logits' mean absolute error stays
# within this share of their spread, and the top token agrees at this share of positions
BF16_MEAN_ERROR, BF16_TOP1 = 0.05, 0.9


def _load(path, device, dtype=torch.float32):
    """The saved tiny model with the h2o attention (``load_model`` would also build the CPU kernels: not needed)."""
    return enable_h2o(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval())


@pytest.fixture
def calls(monkeypatch):
    """Counts the Triton kernels' calls; under the interpreter, CPU tensors take the CUDA dispatch."""
    counts = {"write_slot": 0, "h2o_victim": 0}
    for name in counts:
        kernel = getattr(slots, name)

        def counted(*args, kernel=kernel, name=name):
            counts[name] += 1
            return kernel(*args)

        monkeypatch.setattr(slots, name, counted)
    if INTERPRET:
        monkeypatch.setattr(kernels, "_device_type", lambda tensor: "cuda")
    return counts


def test_step_ops_dispatch(monkeypatch):
    """The C++ ops for CPU tensors, the Triton module for CUDA ones; ``H2O_KV_FUSED=0`` and non-contiguous tensors
    get None (the torch path)."""
    scores, cpp = torch.zeros(2, 3, 4), object()
    monkeypatch.setattr(kernels, "cpu_ops", lambda *tensors: cpp)  # not built here: tests/test_kernels.py does
    assert kernels.step_ops(scores) is cpp
    monkeypatch.setattr(kernels, "_device_type", lambda tensor: "cuda")
    assert kernels.step_ops(scores, scores) is slots
    assert kernels.step_ops(scores, scores.transpose(1, 2)) is None
    monkeypatch.setenv("H2O_KV_FUSED", "0")
    assert kernels.step_ops(scores) is None


def test_h2o_cache_decodes_with_the_triton_kernels(tiny_models, device, calls):
    """fp32 greedy generation on the kernels' device: the reference's tokens and logits."""
    path = tiny_models["llama"]  # GQA: 4 query heads over 2 KV heads
    model = _load(path, device, torch.float32)
    ids = random_prompt(48)
    tokens, logits = greedy_generate(model, ids.to(device), H2OCache(heavy=6, recent=10), 24)
    expected, expected_logits = reference_generate(_load(path, "cpu"), ids, 24, heavy=6, recent=10)
    assert calls["write_slot"] > 0 and calls["h2o_victim"] > 0
    assert tokens[0].tolist() == expected[0]
    torch.testing.assert_close(logits[0].cpu(), expected_logits, atol=1e-4, rtol=1e-4)


def test_h2o_cache_bf16_is_close_to_the_fp32_reference(tiny_models, device, calls):
    """bf16 weights and cache, teacher-forced token by token (``stepwise``), against the fp32 reference."""
    path = tiny_models["llama"]
    ids = random_prompt(80, seed=2)
    model = _load(path, device, torch.bfloat16)
    with torch.no_grad():
        logits = model(ids.to(device), **cache_kwargs(H2OCache(heavy=8, recent=8, stepwise=True))).logits[0]
    expected = reference_logits(_load(path, "cpu"), ids, 8, 8)
    assert calls["write_slot"] > 0 and calls["h2o_victim"] > 0
    logits = logits.float().cpu()
    error = (logits - expected).abs().mean() / expected.std()
    top1 = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert error < BF16_MEAN_ERROR, f"mean |error| is {error:.3f} of the logits' spread"
    assert top1 >= BF16_TOP1, f"top-1 agreement {top1:.2f}"
