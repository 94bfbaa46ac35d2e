"""The benchmark workload: real-text prompts of an exact token length, and the model under test.

Prompts are windows of PG-19 test-split books (Project Gutenberg header and licence stripped), tokenised once and
cut into non-overlapping windows, so every configuration of a run sees the same token ids. For GPU-size shapes a
model can be randomly initialised from a known architecture (``random:llama3-8b``): speed and memory do not
depend on the weights' values, and results record ``random_init: true``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..harness.data import data_path, strip_gutenberg

PG19_BOOKS = ("pg10146_reminiscences_of_pioneer_days_in_st_paul.txt", "pg10321_dragons_blood.txt")

# Architectures for randomly initialised models. Values are the public configs of the named models.
RANDOM_SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Llama-3-8B's shapes with Llama-3.1's 128k context (llama3 RoPE scaling): prompts beyond 8k tokens
    "llama3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama3-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # a few MB: the shape the tests and `scripts/gpu_check.sh --smoke` run the GPU code path with on a CPU
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
}  # fmt: skip


def pg19_text() -> str:
    """The PG-19 books' text without the Project Gutenberg header and licence
    (:func:`h2o_kv.harness.data.strip_gutenberg`)."""
    parts = []
    for name in PG19_BOOKS:
        text = data_path(f"pg19/{name}").read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        parts.append(strip_gutenberg(text).strip())
    return "\n\n".join(parts)


def make_prompts(tokenizer, batch: int, length: int, *, vocab_size: int | None = None) -> torch.Tensor:
    """``[batch, length]`` token ids: ``batch`` non-overlapping windows of the PG-19 text (deterministic).

    When the text holds fewer than ``batch`` windows, windows are reused from the start with a shift of
    ``length // 2`` tokens per pass, so rows still differ. ``vocab_size`` guards random models whose vocabulary is
    smaller than the tokenizer's.
    """
    if length < 1 or batch < 1:
        raise ValueError(f"prompt length and batch must be >= 1, got length={length}, batch={batch}")
    ids = _tokenised_text(tokenizer)
    if ids.numel() < length + length // 2:
        raise ValueError(f"the PG-19 text has {ids.numel()} tokens, too few for {length}-token prompts")
    windows = []
    per_pass = (ids.numel() - length // 2) // length
    for row in range(batch):
        shift = (row // per_pass) * (length // 2) % length
        start = (row % per_pass) * length + shift
        windows.append(ids[start : start + length])
    out = torch.stack(windows)
    if vocab_size is not None and int(out.max()) >= vocab_size:
        out = out % vocab_size
    return out


_TOKENS: dict[int, torch.Tensor] = {}


def _tokenised_text(tokenizer) -> torch.Tensor:
    key = id(tokenizer)
    if key not in _TOKENS:
        ids = tokenizer(pg19_text(), add_special_tokens=False, verbose=False)["input_ids"]
        _TOKENS[key] = torch.tensor(ids, dtype=torch.long)
    return _TOKENS[key]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    random_init: bool
    device: torch.device
    dtype: torch.dtype

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` picks CUDA when available, else CPU; otherwise validated by :func:`h2o_kv.models`."""
    from ..models import resolve_device as resolve

    return resolve(None if device in (None, "auto") else device)


def load_bench_model(name: str | None, *, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """The default model, a local model directory, or ``random:<shape>`` (see :data:`RANDOM_SHAPES`)."""
    from ..models import enable_h2o, load_model, resolve_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name and name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ValueError(f"--model random:<shape>: shape must be one of {', '.join(RANDOM_SHAPES)}; got {shape!r}")
        from transformers import AutoConfig, AutoModelForCausalLM

        spec = dict(RANDOM_SHAPES[shape])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config, dtype=dt)
        model.eval()
        enable_h2o(model)
        return LoadedModel(model, _default_tokenizer(), name, True, dev, dt)
    model, tokenizer = load_model(name, dtype=dt, device=dev)
    if tokenizer is None:
        tokenizer = _default_tokenizer()
    from ..models import DEFAULT_MODEL

    label = name or DEFAULT_MODEL
    return LoadedModel(model, tokenizer, label, False, dev, dt)


class ByteTokenizer:
    """UTF-8 bytes as token ids: the fallback when the default model's tokenizer is not installed."""

    name = "utf8-bytes"

    def __call__(self, text: str, **_) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}


def _default_tokenizer():
    """The default model's tokenizer (real text -> ids for random models, whose vocabulary covers it).

    Falls back to :class:`ByteTokenizer` where the default model is not installed (e.g. a bare GPU machine).
    """
    from ..models import load_tokenizer

    try:
        return load_tokenizer() or ByteTokenizer()
    except (FileNotFoundError, OSError, ImportError):
        return ByteTokenizer()
