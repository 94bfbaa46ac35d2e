"""NVIDIA kvpress presses as an external peer, run on the same model and items as h2o-kv's policies.

kvpress (``pip install "h2o-kv[peers]"``, pinned to 0.5.5, which supports transformers 5.2) compresses the KV
cache once, at the end of the prefill of a context, with one "press" per method; later tokens (a question, an
answer being scored, generated tokens) are appended to a plain ``DynamicCache`` and never evicted. h2o-kv's
policies instead keep the cache bounded during decoding as well.

Presses offered here (:data:`PRESSES`), with the paper each implements:

* ``observed_attention`` - ``ObservedAttentionPress``: mean attention received over the prefill (H2O-like,
  Zhang et al. 2023, arXiv:2306.14048); needs eager attention, switched on temporarily and restored.
* ``snapkv`` - ``SnapKVPress``: attention of the last 64 prompt queries, pooled (Li et al. 2024, arXiv:2404.14469).
* ``tova`` - ``TOVAPress``: attention of the last query, averaged over heads (Oren et al. 2024, arXiv:2401.06104).
* ``streaming_llm`` - ``StreamingLLMPress``: 4 sink tokens plus the most recent ones (Xiao et al. 2023,
  arXiv:2309.17453).
* ``knorm`` - ``KnormPress``: keep the keys with the smallest L2 norm (Devoto et al. 2024, arXiv:2406.11430).

A budget is mapped to kvpress' ``compression_ratio`` (the fraction removed) so that the press keeps exactly as
many entries per layer and KV head as the h2o-kv cache holds after the same prefill (:meth:`h2o_kv.Budget.entries`
of the context length, through a ``kvpress:<press>`` :class:`~h2o_kv.setting.KVSetting`); ``compression_ratio`` is
``1 - budget`` up to rounding.

kvpress 0.5.5 pins ``transformers<5.3``, so the peer runs in its own virtual environment, driven by the same
harness on the same items (docs/eval-tasks.md, "The kvpress peer").
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

KVPRESS_VERSION = "0.5.5"

PRESSES: dict[str, str] = {
    "observed_attention": "ObservedAttentionPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
}
NEEDS_EAGER = frozenset({"observed_attention"})
SNAPKV_WINDOW = 64  # kvpress' default observation window


def kvpress_available() -> bool:
    return importlib.util.find_spec("kvpress") is not None


def require_kvpress():
    """Import kvpress (or raise an ImportError saying how to install it), without its global attention patch.

    On import kvpress wraps every registered attention function (``attention_patch``) for its head-wise presses
    (AdaKV and friends); the wrapper passes ``dropout`` positionally, which breaks attention functions whose sixth
    parameter is not ``dropout``. The presses offered here never use that patch, so it is undone.
    """
    if not kvpress_available():
        raise ImportError(
            f"the kvpress peer needs kvpress=={KVPRESS_VERSION}: pip install 'h2o-kv[peers]' "
            f"(or pip install kvpress=={KVPRESS_VERSION})"
        )
    import kvpress

    _undo_attention_patch()
    return kvpress


def _undo_attention_patch() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in list(ALL_ATTENTION_FUNCTIONS):
        function = original = ALL_ATTENTION_FUNCTIONS[name]
        while getattr(original, "__qualname__", "").endswith("attention_patch.<locals>.wrapper"):
            original = original.__closure__[0].cell_contents
        if original is not function:
            del ALL_ATTENTION_FUNCTIONS[name]  # kvpress set the wrapper as a local override: drop it
            if ALL_ATTENTION_FUNCTIONS.get(name) is not original:
                ALL_ATTENTION_FUNCTIONS[name] = original


def check_press(name: str) -> str:
    """Validate a press name (``snapkv``, ``tova``, ...) and return it."""
    if name not in PRESSES:
        raise ValueError(f"--peer must be one of {', '.join(PRESSES)}; got {name!r}")
    return name


def compression_ratio(length: int, keep: int) -> float:
    """kvpress ``compression_ratio`` that keeps exactly ``keep`` of ``length`` entries (0.0 keeps all).

    kvpress keeps ``int(length * (1 - ratio))`` entries; aiming half an entry above ``keep`` makes float
    rounding harmless.
    """
    if not 0 < keep <= length:
        raise ValueError(f"cannot keep {keep} of {length} entries")
    return 0.0 if keep >= length else 1.0 - (keep + 0.5) / length


def make_press(name: str, ratio: float, length: int | None = None):
    """Instantiate press ``name`` with ``compression_ratio=ratio``.

    kvpress' SnapKV asserts that the context is longer than its 64-query window; for such short contexts (only)
    the window is reduced to half the context so that short prompts still run.
    """
    kvpress = require_kvpress()
    cls = getattr(kvpress, PRESSES[check_press(name)])
    if name == "snapkv" and length is not None and length <= SNAPKV_WINDOW:
        return cls(compression_ratio=ratio, window_size=max(1, length // 2))
    return cls(compression_ratio=ratio)


@contextlib.contextmanager
def press_context(model, name: str, ratio: float, length: int | None = None) -> Iterator[object]:
    """Apply press ``name`` at ``compression_ratio=ratio`` to every prefill forward run inside the block.

    ObservedAttention reads the attention probabilities, so the model is switched to eager attention for the
    block and restored afterwards (to ``"h2o"``, which with a ``DynamicCache`` is plain SDPA).
    """
    press = make_press(name, ratio, length)
    previous = model.config._attn_implementation
    eager = name in NEEDS_EAGER and previous != "eager"
    if eager:
        model.set_attn_implementation("eager")
    try:
        with press(model):
            yield press
    finally:
        if eager:
            model.set_attn_implementation(previous)


@dataclass
class PressState:
    """A context prefilled under a press: its compressed ``DynamicCache`` and the next absolute position.

    After compression the cache is shorter than the context, so later forwards pass ``position_ids``
    explicitly (as kvpress' own pipeline does) to keep RoPE positions right.
    """

    cache: Any
    next_position: int
    kept: int
    context_length: int
    compression_ratio: float
    logits: Any = field(repr=False)  # [batch, vocab]: logits after the last context token


def press_prefill(model, input_ids, name: str, keep: int) -> PressState:
    """Prefill ``input_ids`` ([1, L]) with press ``name`` compressing the cache to ``keep`` entries per layer and
    KV head (``KVSetting.entries(L)``)."""
    import torch
    from transformers import DynamicCache

    from .hf.compat import cache_kwargs

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"press_prefill expects input_ids of shape [1, L], got {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    ratio = compression_ratio(length, keep)
    cache = DynamicCache()
    with torch.no_grad(), press_context(model, name, ratio, length):
        out = model(input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return PressState(cache, length, cache.get_seq_length(), length, ratio, out.logits[:, -1])


def press_extend(model, state: PressState, input_ids):
    """Feed ``input_ids`` ([B, T]) after the compressed context (no eviction); returns logits [B, T, vocab]."""
    import torch

    from .hf.compat import cache_kwargs

    batch, steps = input_ids.shape
    positions = torch.arange(state.next_position, state.next_position + steps, device=input_ids.device)
    with torch.no_grad():
        out = model(input_ids, **cache_kwargs(state.cache), position_ids=positions.expand(batch, -1), use_cache=True)
    state.next_position += steps
    return out.logits


def press_expand(state: PressState, copies: int) -> None:
    """Repeat the (batch 1) compressed cache ``copies`` times along the batch, in place."""
    if copies > 1:
        state.cache.batch_repeat_interleave(copies)
        state.logits = state.logits.repeat_interleave(copies, dim=0)
