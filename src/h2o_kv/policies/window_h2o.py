"""Question-aware H2O: SnapKV's observation window (Li et al. 2024, arXiv:2404.14469) for the prompt, H2O's
accumulation (Zhang et al. 2023, arXiv:2306.14048) for every later token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .h2o import H2O

DECODES = ("evict", "grow")


@dataclass
class WindowH2O(H2O):
    """H2O whose prompt scores come from the prompt's last ``window`` queries only.

    ``score <- score + last``: after a prompt chunk, ``last`` is the mass the chunk's last ``window`` rows paid
    (SnapKV's observation window: when the question ends the prompt, entries are ranked by what the question reads);
    at a decode step it is that step's mass, so from then on the score is H2O's running sum and one entry is evicted
    per step. ``window=1`` with a one-token prompt chunk and stepwise feeding is H2O. The ``recent`` newest entries
    are protected as in H2O (and cover the window when ``recent >= window``).

    ``decode``: ``evict`` (H2O: the cache stays at ``heavy + recent`` entries, one eviction per step) or ``grow``
    (compress the prompt once, then let the cache grow by every later token, as SnapKV, KVzip and kvpress' presses
    do: in kvpress' protocol, where the question follows the compressed context, a press holds the question and the
    answer on top of its budget, and ``grow`` gives the policy exactly that memory).
    """

    window: int = 32
    decode: str = "evict"

    name: ClassVar[str] = "window_h2o"

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}")

    @property
    def evicts_during_decode(self) -> bool:
        return self.decode == "evict"

    @property
    def observation_window(self) -> int:
        return self.window

    def accumulate(self, scores, mass, last):
        return scores + last

    def describe(self) -> str:
        grow = ", decode=grow" if self.decode == "grow" else ""
        return f"{self.name}(heavy={self.heavy}, recent={self.recent}, window={self.window}{grow})"
