"""A tiny random Llama vLLM's CPU backend can run (head_dim 32: the CPU kernel's smallest), with peaky attention."""

from __future__ import annotations

import torch

QK_SCALE = 8.0  # as tests/conftest.py: makes attention rows clearly peaked, so evictions are not near-ties


def make_tiny_llama(path, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                module.weight *= QK_SCALE
    model.save_pretrained(path)
    return model
