"""TOVA: Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import EntryView, Policy


@dataclass
class TOVA(Policy):
    """Keep the ``heavy + recent`` entries the current (last) query attends to most; no protected recent window.

    After every step the entry with the lowest attention probability from the newest query - summed over the
    query heads of its KV group - is evicted (possibly the newest token itself). Scores are not accumulated: each
    step's ranking uses the current query only. After a prompt chunk the chunk's last row ranks the candidates.
    ``heavy`` and ``recent`` only set the budget.
    """

    name: ClassVar[str] = "tova"

    def accumulate(self, scores: torch.Tensor, mass: torch.Tensor | None, last: torch.Tensor | None):
        return last

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        return entries.scores
