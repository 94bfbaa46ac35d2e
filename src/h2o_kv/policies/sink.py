"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, EntryView, Policy


@dataclass
class Sink(Policy):
    """Keep the first ``sinks`` real tokens of each sequence plus the most recent ones (same total budget)."""

    sinks: int = 4
    name: ClassVar[str] = "sink"
    needs_attention: ClassVar[bool] = False

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        is_sink = entries.pos < (entries.start + self.sinks)[:, None, None]
        return entries.pos.float().masked_fill(is_sink, INF)
