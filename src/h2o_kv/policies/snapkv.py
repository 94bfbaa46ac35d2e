"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import INF, EntryView, Policy

POOLINGS = ("max", "avg")


@dataclass
class SnapKV(Policy):
    """Compress a prompt once, by the attention its last ``window`` queries pay to the earlier entries.

    Each earlier entry's score is the probability mass it receives from the observation window (the last
    ``window`` rows of the prompt chunk, summed over those rows and the query heads of the KV group), smoothed by a
    1-D ``pooling`` (``max`` or ``avg``, zero padded) over ``kernel`` neighbouring entries in position order. The
    window's own entries are always kept, the best-scored others fill the budget ``heavy + recent``. Decode steps
    evict nothing (``evicts_during_decode = False``): the cache grows from the compressed prompt, as in the paper
    and in kvpress. Defaults follow SnapKV's published configuration (window 32, kernel 7, max pooling).

    The pooling must span the tokens of one fact: where a tokenizer spells a number digit by digit (SmolLM2), the
    window's attention peaks on the fact's key and kernel 7 keeps only the first digits of a 7-digit value;
    ``snapkv:kernel=21`` keeps it (RULER 1k, question in the prompt, 20%: 0.57 against 0.01; docs/quality.md).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    name: ClassVar[str] = "snapkv"
    evicts_during_decode: ClassVar[bool] = False

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1, got {self.kernel!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    @property
    def observation_window(self) -> int:
        return self.window

    def accumulate(self, scores: torch.Tensor, mass: torch.Tensor | None, last: torch.Tensor | None):
        return last  # the observation window's mass of the latest chunk replaces older scores

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        protected = entries.valid & self.recent_window(entries, min(self.window, self.capacity))
        candidates = entries.valid & ~protected
        # lay the candidates out in position order (others at the end, as zero padding), pool, scatter back
        order = entries.pos.masked_fill(~candidates, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
        ordered = entries.scores.masked_fill(~candidates, 0.0).gather(-1, order)
        flat = ordered.reshape(-1, 1, ordered.shape[-1])
        pad = self.kernel // 2
        if self.pooling == "max":
            pooled = F.max_pool1d(F.pad(flat, (pad, pad)), self.kernel, stride=1)
        else:
            pooled = F.avg_pool1d(flat, self.kernel, stride=1, padding=pad, count_include_pad=True)
        rank = torch.empty_like(entries.scores).scatter_(-1, order, pooled.view_as(ordered))
        return rank.masked_fill(protected, INF)

    def describe(self) -> str:
        return (
            f"{self.name}(heavy={self.heavy}, recent={self.recent}, window={self.window}, kernel={self.kernel}, "
            f"pooling={self.pooling})"
        )
