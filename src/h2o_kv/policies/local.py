"""Recent-only baseline (the "Local" row of the H2O paper's tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import EntryView, Policy


@dataclass
class Local(Policy):
    """Keep the ``heavy + recent`` most recent entries: a sliding window with the same budget as H2O."""

    name: ClassVar[str] = "local"
    needs_attention: ClassVar[bool] = False

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        return entries.pos.float()
