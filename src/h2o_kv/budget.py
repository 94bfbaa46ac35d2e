"""The one budget rule: how many KV entries a layer keeps per sequence and KV head.

A budget is either absolute (``heavy`` heavy hitters + ``recent`` newest entries) or a ``ratio`` of the prompt, as in
the H2O paper (Zhang et al., NeurIPS 2023, arXiv:2306.14048), whose "20% budget" is ``ratio=0.2`` split evenly:
``heavy = recent = max(1, floor(ratio * L / 2))`` for an ``L``-token prompt (the padded length of a batch). The floor
of one entry each means a short prompt never leaves an empty cache; the count is fixed for the whole generation.

A ratio may have a floor, ``min_entries``: never fewer kept entries than that (``heavy = ceil(m / 2)``, ``recent =
floor(m / 2)`` where the ratio gives less), so a request whose prompt and reply fit in ``min_entries`` tokens evicts
nothing and runs exactly as the full cache, and the ratio applies from ``L >= min_entries / ratio`` on. Off (the
paper's exact rule) unless given; the server turns it on (:data:`h2o_kv.vllm.config.MIN_ENTRIES`), where one
server-wide ratio meets both 30-token chat prompts and long documents.

Everything that turns user options into entry counts goes through :class:`Budget`: the transformers cache, the
evaluations, the kvpress peer, the bench and the vLLM backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Budget:
    """``heavy``/``recent`` entry counts, or a ``ratio`` in (0, 1] of the prompt length (give one form), the
    ratio optionally with a floor of ``min_entries`` kept entries (None or 0: no floor)."""

    heavy: int | None = None
    recent: int | None = None
    ratio: float | None = None
    min_entries: int | None = None

    def __post_init__(self):
        counts = self.heavy is not None or self.recent is not None
        if self.min_entries is not None and not _is_count(self.min_entries):
            raise ValueError(f"min_entries must be an integer >= 0 (0: no floor), got {self.min_entries!r}")
        if self.ratio is not None:
            if counts:
                raise ValueError("give either budget (a ratio) or heavy/recent (entry counts), not both")
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
                raise ValueError(f"budget must be a ratio in (0, 1] of the prompt length, got {self.ratio!r}")
            return
        if self.min_entries:
            raise ValueError("min_entries is a floor under a ratio budget; with heavy/recent the counts are the budget")
        if not counts:
            raise ValueError("give budget (a ratio in (0, 1] of the prompt) or heavy and recent (entry counts)")
        for name in ("heavy", "recent"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"{name} is required with heavy/recent (an integer >= 0)")
            if not _is_count(value):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.heavy + self.recent == 0:
            raise ValueError("heavy + recent must be >= 1: a cache that keeps nothing cannot generate")

    @classmethod
    def of(
        cls,
        budget: float | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        min_entries: int | None = None,
    ) -> Budget:
        """The budget of user options ``budget=`` (ratio, with an optional ``min_entries`` floor) or
        ``heavy=``/``recent=`` (counts)."""
        return cls(heavy=heavy, recent=recent, ratio=budget, min_entries=min_entries)

    @property
    def is_ratio(self) -> bool:
        return self.ratio is not None

    def split(self, prompt_length: int) -> tuple[int, int]:
        """``(heavy, recent)`` for a prompt of ``prompt_length`` tokens."""
        if self.ratio is None:
            return self.heavy, self.recent
        half = max(1, math.floor(self.ratio * prompt_length / 2))
        floor = self.min_entries or 0
        return max(half, floor - floor // 2), max(half, floor // 2)

    def floored(self, prompt_length: int) -> bool:
        """Whether ``min_entries``, not the ratio, sets the count for a prompt of ``prompt_length`` tokens."""
        if self.ratio is None or not self.min_entries:
            return False
        return self.split(prompt_length) != Budget(ratio=self.ratio).split(prompt_length)

    def entries(self, prompt_length: int) -> int:
        """Entries kept after a prompt of ``prompt_length`` tokens (never more than the prompt)."""
        return min(prompt_length, sum(self.split(prompt_length)))

    def describe(self) -> str:
        if self.ratio is None:
            return f"heavy={self.heavy}, recent={self.recent}"
        return f"budget={self.ratio}" + (f", min_entries={self.min_entries}" if self.min_entries else "")
