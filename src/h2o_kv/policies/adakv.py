"""Ada-KV: head-adaptive budget allocation (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation for Efficient LLM Inference", arXiv:2407.11550), over any policy's score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF
from .h2o import H2O
from .snapkv import SnapKV
from .window_h2o import WindowH2O


def kept_index(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, counts)`` of a kept mask ``[batch, heads, n]``: each row's kept entries first, padded to the largest
    row's count (at least 1), as :meth:`~h2o_kv.Policy.select` returns them."""
    counts = kept.sum(-1)
    index = kept.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., : max(1, int(counts.max()))]
    return index, counts


@dataclass
class HeadAdaptive:
    """Mixin: a prompt chunk keeps the layer's best ``heads * capacity`` entries over all its KV heads together.

    The paper's rule: the layer's total budget ``B = heads * capacity`` goes to the top ``B`` scores of the
    concatenated heads, so a head whose attention is concentrated gives its slots to a head whose attention is
    spread; with the paper's safeguard each head first keeps its own best ``ceil(alpha * capacity)`` entries
    (``alpha=0`` is the pure rule). The counts per head stay fixed afterwards: a policy that evicts during decode
    frees one entry per head and step. Scores must be comparable across heads (attention mass and pooled mass are).

    Memory: the layer holds exactly ``heads * capacity`` valid entries per sequence (the uniform total); the
    transformers backend stores each head's entries packed (:mod:`h2o_kv.hf.packed`: its count, +1 free slot when
    evicting), the slot metadata padded to the largest head's count, at most
    ``heads * capacity - (heads - 1) * ceil(alpha * capacity)`` (+1).
    """

    alpha: float = 0.2

    head_adaptive: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {self.alpha!r}")
        super_post = getattr(super(), "__post_init__", None)
        if super_post is not None:
            super_post()

    def select(self, rank: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, n = rank.shape
        floor = min(keep, math.ceil(self.alpha * keep))
        if floor > 0:  # the safeguard: each head's own best entries first
            rank = rank.scatter(-1, rank.topk(floor, dim=-1).indices, INF)
        chosen = rank.flatten(1).topk(heads * keep, dim=-1).indices
        kept = torch.zeros((batch, heads * n), dtype=torch.bool, device=rank.device).scatter_(1, chosen, True)
        return kept_index(kept.view(batch, heads, n) & (rank > -INF))

    def describe(self) -> str:
        return super().describe()[:-1] + f", alpha={self.alpha})"


@dataclass
class AdaH2O(HeadAdaptive, H2O):
    """H2O's accumulated attention with head-adaptive budgets (``ada_h2o``)."""

    name: ClassVar[str] = "ada_h2o"


@dataclass
class AdaSnapKV(HeadAdaptive, SnapKV):
    """SnapKV with head-adaptive budgets, the paper's Ada-SnapKV (``ada_snapkv``)."""

    name: ClassVar[str] = "ada_snapkv"


@dataclass
class AdaWindowH2O(HeadAdaptive, WindowH2O):
    """The question-aware H2O (observation window, then H2O's accumulation) with head-adaptive budgets."""

    name: ClassVar[str] = "ada_window_h2o"
