"""One budget shared by every layer and KV head (KVzip's allocation: Kim et al. 2025, arXiv:2505.23416; Ada-KV's
rule, arXiv:2407.11550, taken over the whole model instead of one layer), over any policy's score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .adakv import HeadAdaptive, kept_index
from .base import INF
from .h2o import H2O
from .snapkv import SnapKV
from .window_h2o import WindowH2O


@dataclass
class AcrossLayers(HeadAdaptive):
    """Mixin: a prompt keeps the model's best ``layers * heads * capacity`` entries over all layers and KV heads.

    A layer whose attention is concentrated gives its slots to one whose attention is spread, as Ada-KV does between
    the heads of a layer. The backend keeps every candidate of a prompt chunk until all layers have scored it, then
    ranks them together (``H2OCache.select_across_layers``). With ``alpha > 0`` each head first keeps its own best
    ``ceil(alpha * capacity)`` entries (Ada-KV's safeguard; KVzip uses none, the default). Per-head counts stay fixed
    afterwards (one eviction per head and step for a policy that evicts while decoding). Scores must be comparable
    across layers (attention mass is: each query row's probabilities sum to 1 in every layer).

    ``recent_share``: the share of each head's ``capacity`` kept as its recent window (at least one entry), the rest
    going to the pooled ranking; None keeps the budget's split (even for a ratio, as in H2O). Pooled over all layers,
    every head's protected window is paid for in every layer: a smaller share leaves more of the model's budget to
    the best-ranked entries (chosen on the tuning split at 10%, docs/quality.md). The capacity is unchanged.

    Memory: the model holds exactly ``layers * heads * capacity`` valid entries per sequence (the uniform total),
    stored packed per head in the transformers backend (:mod:`h2o_kv.hf.packed`: the bytes of the entries kept plus
    one free slot per head); while a prompt is scored every layer holds all its entries (as a full cache would).
    """

    alpha: float = 0.0
    recent_share: float | None = None

    def __post_init__(self):
        share = self.recent_share
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ValueError(f"recent_share must be a number in [0, 1], got {share!r}")
            capacity = self.heavy + self.recent
            self.recent = min(capacity, max(1, round(share * capacity)))
            self.heavy = capacity - self.recent
        super().__post_init__()

    across_layers: ClassVar[bool] = True

    def select_layers(self, ranks: list[torch.Tensor], keep: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kept entries of each layer from ``ranks`` (one ``[batch, heads, n]`` per layer, ``-inf``: invalid):
        ``(index, counts)`` per layer, as :meth:`HeadAdaptive.select` gives for one."""
        floor = min(keep, math.ceil(self.alpha * keep))
        if floor > 0:
            ranks = [rank.scatter(-1, rank.topk(min(floor, rank.shape[-1]), dim=-1).indices, INF) for rank in ranks]
        batch, heads = ranks[0].shape[:2]
        flat = torch.cat([rank.flatten(1) for rank in ranks], dim=1)
        chosen = flat.topk(min(len(ranks) * heads * keep, flat.shape[1]), dim=-1).indices
        kept = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, chosen, True) & (flat > -INF)
        sizes = [rank[0].numel() for rank in ranks]
        return [kept_index(part.view(rank.shape)) for part, rank in zip(kept.split(sizes, dim=1), ranks, strict=True)]


@dataclass
class GlobalH2O(AcrossLayers, H2O):
    """H2O's accumulated attention with one budget over all layers and heads (``global_h2o``)."""

    name: ClassVar[str] = "global_h2o"


@dataclass
class GlobalSnapKV(AcrossLayers, SnapKV):
    """SnapKV's observation-window score with one budget over all layers and heads (``global_snapkv``)."""

    name: ClassVar[str] = "global_snapkv"


@dataclass
class GlobalWindowH2O(AcrossLayers, WindowH2O):
    """The question-aware H2O (observation window, then H2O's accumulation) with one budget over all layers and heads
    (``global_window_h2o``); with ``--reconstruct`` the window is the context-reconstruction request."""

    name: ClassVar[str] = "global_window_h2o"
