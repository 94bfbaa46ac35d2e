"""NVIDIA kvpress presses as an external peer, run on the same model and items as h2o-kv's policies.

kvpress (``pip install "h2o-kv[peers]"``, pinned to 0.5.5, which supports transformers 5.2) compresses the KV
cache once, at the end of the prefill of a context, with one "press" per method; later tokens (a question, an
answer being scored, generated tokens) are appended to a plain ``DynamicCache`` and never evicted. h2o-kv's
policies instead keep the cache bounded during decoding as well.

Presses offered here (:data:`PRESSES`), with the paper each implements (kvpress' defaults otherwise):

* ``observed_attention`` - ``ObservedAttentionPress``: mean attention received over the prefill (H2O-like,
  Zhang et al. 2023, arXiv:2306.14048); needs eager attention, switched on temporarily and restored.
* ``snapkv`` - ``SnapKVPress``: attention of the last 64 prompt queries, pooled (Li et al. 2024, arXiv:2404.14469).
* ``pyramidkv`` - ``PyramidKVPress``: SnapKV's score with per-layer budgets falling linearly with depth, their mean
  the budget (Cai et al. 2024, arXiv:2406.02069). kvpress falls back to plain SnapKV when the smallest layer budget
  would be under the 64-query window, i.e. below ``64 * 20 / budget`` context tokens (6,400 at 20%).
* ``tova`` - ``TOVAPress``: attention of the last query, averaged over heads (Oren et al. 2024, arXiv:2401.06104).
* ``streaming_llm`` - ``StreamingLLMPress``: 4 sink tokens plus the most recent ones (Xiao et al. 2023,
  arXiv:2309.17453).
* ``knorm`` - ``KnormPress``: keep the keys with the smallest L2 norm (Devoto et al. 2024, arXiv:2406.11430).
* ``keydiff`` - ``KeyDiffPress``: keep the keys least similar to the mean key (Park et al. 2025, arXiv:2504.15364).
* ``expected_attention`` - ``ExpectedAttentionPress``: attention expected from future queries, estimated from the
  statistics of the prompt's queries (Devoto et al. 2025, arXiv:2510.00636).
* ``adakv_expected_attention`` - ``AdaKVPress`` over ExpectedAttention: the layer's budget shared across its heads
  (Feng et al. 2024, arXiv:2407.11550).
* ``criticalkv_expected_attention`` / ``critical_adakv_expected_attention`` - ``CriticalKVPress`` /
  ``CriticalAdaKVPress`` over ExpectedAttention (without its value norm, as kvpress advises): scores re-weighted by
  the norm of each value's output projection (Feng et al. 2025, arXiv:2502.03805).
* ``kvzip`` - ``KVzipPress``: scores from the attention paid while the model is asked to repeat the context
  (query-agnostic; Kim et al. 2025, arXiv:2505.23416); about three prefills' work.
* ``decoding_knorm`` / ``decoding_expected_attention`` - ``PrefillDecodingPress``: the scorer compresses the
  prefill to the budget, then kvpress' ``DecodingPress`` brings the cache back to the same count after every later
  forward (``compression_interval=1``, ``target_size`` the budget's entries): a press bounded while generating, as an
  H2O cache is. Its hooks stay on for the whole session (:func:`press_prefill` to :func:`press_close`): generation
  only (RULER, the needle, XSUM); the lm-eval tasks refuse it.

The head-wise presses (AdaKV, CriticalAdaKV, KVzip) keep each layer's total but not the same count per head (KVzip:
the model's total, shared over layers too): they mask the dropped entries (kvpress' attention patch on ``sdpa``)
instead of removing them, so their ``kept`` is counted from the mask, as the mean over layers.

A budget is mapped to kvpress' ``compression_ratio`` (the fraction removed) so that the press keeps exactly as
many entries per layer and KV head as the h2o-kv cache holds after the same prefill (:meth:`h2o_kv.Budget.entries`
of the context length, through a ``kvpress:<press>`` :class:`~h2o_kv.harness.setting.KVSetting`);
``compression_ratio`` is
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

SNAPKV_WINDOW = 64  # kvpress' default observation window (SnapKV, PyramidKV)


@dataclass(frozen=True)
class Press:
    """One kvpress method: its class (and the scorer it wraps, if any) and how it must be run."""

    cls: str
    scorer: str | None = None  # the ScorerPress a wrapper press (AdaKV, CriticalKV) wraps
    scorer_options: tuple[tuple[str, Any], ...] = ()
    eager: bool = False  # reads attention probabilities: run under eager attention
    head_wise: bool = False  # masks entries per head (kvpress' attention patch) instead of removing them
    across_layers: bool = False  # shares the budget over all layers (per-layer counts differ, their mean is kept)
    windowed: bool = False  # asserts the context is longer than its observation window
    rounds: bool = False  # keeps round(L * (1 - ratio)) entries, not int(...): given the exact ratio of the count
    decoding: bool = False  # also compresses while decoding, back to the budget after every forward

    def build(self, kvpress, ratio: float, length: int | None = None):
        """The press at ``compression_ratio=ratio`` (the window halved to fit a context shorter than it)."""
        options = {}
        if self.rounds and length is not None and ratio > 0:
            ratio = 1.0 - int(length * (1.0 - ratio)) / length
        if self.windowed and length is not None and length <= SNAPKV_WINDOW:
            options["window_size"] = max(1, length // 2)
        if self.decoding:
            if length is None:
                raise ValueError("a decoding press needs the context length: its budget is a count of entries")
            keep = max(1, int(length * (1.0 - ratio)))
            decoding = kvpress.DecodingPress(
                base_press=getattr(kvpress, self.scorer)(), compression_interval=1, target_size=keep
            )
            prefill = getattr(kvpress, self.scorer)(compression_ratio=ratio)
            return getattr(kvpress, self.cls)(prefilling_press=prefill, decoding_press=decoding)
        if self.scorer is None:
            return getattr(kvpress, self.cls)(compression_ratio=ratio, **options)
        scorer = getattr(kvpress, self.scorer)(compression_ratio=ratio, **dict(self.scorer_options))
        return getattr(kvpress, self.cls)(press=scorer)


_NO_VNORM = (("use_vnorm", False),)
PRESSES: dict[str, Press] = {
    "observed_attention": Press("ObservedAttentionPress", eager=True),
    "snapkv": Press("SnapKVPress", windowed=True),
    "pyramidkv": Press("PyramidKVPress", windowed=True, rounds=True),
    "tova": Press("TOVAPress"),
    "streaming_llm": Press("StreamingLLMPress"),
    "knorm": Press("KnormPress"),
    "keydiff": Press("KeyDiffPress"),
    "expected_attention": Press("ExpectedAttentionPress"),
    "adakv_expected_attention": Press("AdaKVPress", "ExpectedAttentionPress", head_wise=True),
    "criticalkv_expected_attention": Press("CriticalKVPress", "ExpectedAttentionPress", _NO_VNORM),
    "critical_adakv_expected_attention": Press(
        "CriticalAdaKVPress", "ExpectedAttentionPress", _NO_VNORM, head_wise=True
    ),
    "kvzip": Press("KVzipPress", head_wise=True, across_layers=True),
    "decoding_knorm": Press("PrefillDecodingPress", "KnormPress", decoding=True),
    "decoding_expected_attention": Press("PrefillDecodingPress", "ExpectedAttentionPress", decoding=True),
}
DECODING_PRESSES = tuple(name for name, press in PRESSES.items() if press.decoding)
# kvpress' attention patch stays on the attention functions it was written for, where it is a pass-through unless a
# head-wise press set ``masked_key_indices``; every other function (h2o-kv's own) gets its original back
PATCHED_ATTENTION = "sdpa"


def kvpress_available() -> bool:
    return importlib.util.find_spec("kvpress") is not None


def require_kvpress():
    """Import kvpress (or raise an ImportError saying how to install it), its attention patch kept on ``sdpa`` only.

    On import kvpress wraps every registered attention function (``attention_patch``) for its head-wise presses
    (AdaKV and friends); the wrapper passes ``dropout`` positionally, which breaks attention functions whose sixth
    parameter is not ``dropout`` (h2o-kv's own). Those get their original function back; presses prefill on ``sdpa``.
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
        if name == PATCHED_ATTENTION:
            continue
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
    """Instantiate press ``name`` with ``compression_ratio=ratio`` (for a context of ``length`` tokens)."""
    return PRESSES[check_press(name)].build(require_kvpress(), ratio, length)


@contextlib.contextmanager
def attention(model, implementation: str) -> Iterator[None]:
    """Run the block under ``implementation`` (``sdpa``, ``eager``) and restore the model's own afterwards."""
    previous = model.config._attn_implementation
    if previous != implementation:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if previous != implementation:
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def press_context(model, name: str, ratio: float, length: int | None = None) -> Iterator[object]:
    """Apply press ``name`` at ``compression_ratio=ratio`` to every prefill forward run inside the block.

    The block runs under ``sdpa`` (kvpress' patched function), or ``eager`` for a press that reads the attention
    probabilities (ObservedAttention); the model's own attention is restored afterwards.
    """
    press = make_press(name, ratio, length)
    with attention(model, "eager" if PRESSES[name].eager else PATCHED_ATTENTION), press(model):
        yield press


def kept_entries(model, cache) -> int:
    """Entries kept per layer and KV head after a press, averaged over layers: the cache's length, less the
    entries a head-wise press masked (``masked_key_indices``: one index per masked entry and head)."""
    heads = model.config.num_key_value_heads
    counts = []
    for index, layer in enumerate(cache.layers):
        masked = getattr(model.model.layers[index].self_attn, "masked_key_indices", None)
        counts.append(layer.keys.shape[2] - (0 if masked is None else len(masked[0]) / heads))
    return round(sum(counts) / len(counts))


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
    masked: bool = False  # a head-wise press's mask must be applied by every later forward (kvpress' patched sdpa)
    open_press: contextlib.ExitStack | None = field(default=None, repr=False)  # a decoding press, on until closed


def press_prefill(model, input_ids, name: str, keep: int) -> PressState:
    """Prefill ``input_ids`` ([1, L]) with press ``name`` compressing the cache to ``keep`` entries per layer and
    KV head (``KVSetting.entries(L)``; a layer- or head-wise press keeps that many on average)."""
    import torch
    from transformers import DynamicCache

    from ..hf.compat import cache_kwargs

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"press_prefill expects input_ids of shape [1, L], got {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    ratio = compression_ratio(length, keep)
    cache = DynamicCache()
    with contextlib.ExitStack() as stack:
        stack.enter_context(press_context(model, name, ratio, length))
        with torch.no_grad():
            out = model(input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        open_press = stack.pop_all() if PRESSES[name].decoding else None  # kept on for the decode steps
    kept = kept_entries(model, cache)
    return PressState(
        cache, length, kept, length, ratio, out.logits[:, -1], masked=PRESSES[name].head_wise, open_press=open_press
    )


def press_close(state: PressState) -> None:
    """End a decoding press's session: its hooks off, the model's attention restored (nothing for other presses)."""
    if state.open_press is not None:
        state.open_press.close()
        state.open_press = None


def press_extend(model, state: PressState, input_ids):
    """Feed ``input_ids`` ([B, T]) after the compressed context (no eviction; a head-wise press's mask holds);
    returns logits [B, T, vocab]."""
    import torch

    from ..hf.compat import cache_kwargs

    batch, steps = input_ids.shape
    positions = torch.arange(state.next_position, state.next_position + steps, device=input_ids.device)
    implementation = PATCHED_ATTENTION if state.masked else model.config._attn_implementation
    with torch.no_grad(), attention(model, implementation):
        out = model(input_ids, **cache_kwargs(state.cache), position_ids=positions.expand(batch, -1), use_cache=True)
    state.next_position += steps
    return out.logits


def press_expand(model, state: PressState, copies: int) -> None:
    """Repeat the (batch 1) compressed cache ``copies`` times along the batch, in place (a head-wise press's mask
    with it)."""
    if copies <= 1:
        return
    state.cache.batch_repeat_interleave(copies)
    state.logits = state.logits.repeat_interleave(copies, dim=0)
    for layer in model.model.layers:
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            batch, head, seq = masked
            copy = batch.new_tensor(range(copies)).repeat(len(batch))
            layer.self_attn.masked_key_indices = (
                batch.repeat_interleave(copies) * copies + copy,
                head.repeat_interleave(copies),
                seq.repeat_interleave(copies),
            )
