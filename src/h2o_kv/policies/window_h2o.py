"""Question-aware H2O: SnapKV's observation window (Li et al. 2024, arXiv:2404.14469) for the prompt, H2O's
accumulation (Zhang et al. 2023, arXiv:2306.14048) for every later token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .h2o import H2O


@dataclass
class WindowH2O(H2O):
    """H2O whose prompt scores come from the prompt's last ``window`` queries only.

    ``score <- score + last``: after a prompt chunk, ``last`` is the mass the chunk's last ``window`` rows paid
    (SnapKV's observation window: when the question ends the prompt, entries are ranked by what the question reads);
    at a decode step it is that step's mass, so from then on the score is H2O's running sum and one entry is evicted
    per step. ``window=1`` with a one-token prompt chunk and stepwise feeding is H2O. The ``recent`` newest entries
    are protected as in H2O (and cover the window when ``recent >= window``).
    """

    window: int = 32

    name: ClassVar[str] = "window_h2o"

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")

    @property
    def observation_window(self) -> int:
        return self.window

    def accumulate(self, scores, mass, last):
        return scores + last

    def describe(self) -> str:
        return f"{self.name}(heavy={self.heavy}, recent={self.recent}, window={self.window})"
