"""A2SF: Accumulative Attention Scoring with Forgetting Factor (Jo and Shin 2024, arXiv:2407.20485)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .h2o import H2O


@dataclass
class A2SF(H2O):
    """H2O whose running sum forgets: ``score <- decay * score + mass`` at every attention call.

    A decode step is one call, so over generated (or stepwise-fed) tokens the score of an entry is
    ``sum_t decay**(T - t) * attention_t``, the paper's forgetting factor; a prompt chunk compressed at once is one
    call (its rows are summed undecayed, as H2O does). ``decay=1`` is exactly :class:`~h2o_kv.policies.H2O` (same
    scores, same victims, the fused CPU path included). Old heavy hitters fade, so after a topic change the new
    text's heavy hitters can win. Same recent window as H2O.
    """

    decay: float = 0.99

    name: ClassVar[str] = "a2sf"

    def __post_init__(self):
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise ValueError(f"decay must be a number in (0, 1], got {self.decay!r}")

    def accumulate(self, scores, mass, last):
        return scores + mass if self.decay == 1 else scores.mul(self.decay).add_(mass)

    @property
    def fused_h2o_ranking(self) -> bool:
        return self.decay == 1  # exactly H2O

    def describe(self) -> str:
        return f"{self.name}(heavy={self.heavy}, recent={self.recent}, decay={self.decay})"
