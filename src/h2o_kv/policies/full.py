"""The full cache inside the same frame: nothing is ever evicted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import EntryView, Policy


@dataclass
class Full(Policy):
    """No eviction; the layer storage grows like a plain ``DynamicCache``."""

    name: ClassVar[str] = "full"
    needs_attention: ClassVar[bool] = False
    evicts_during_decode: ClassVar[bool] = False

    @property
    def capacity(self) -> float:
        return float("inf")

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        return entries.pos.float()

    def describe(self) -> str:
        return "full"
