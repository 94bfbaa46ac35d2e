"""Random eviction: an ablation that isolates the value of heavy-hitter scoring (H2O paper, Zhang et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, EntryView, Policy

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "hash32" xor-shift-multiply finaliser) on int64 tensors holding values < 2**32."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def random_keys(seed: int, pos: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Pseudo-random keys in [0, 1) for entries ``[batch, kv_heads, n]``, a pure function of
    (seed, KV head, position relative to the sequence's first real token): reproducible, and independent of the
    batch a sequence runs in and of its padding."""
    heads = torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
    relative = (pos - start.view(-1, 1, 1)) & _MASK32
    key = _mix32(torch.full_like(pos, seed & _MASK32))
    key = _mix32(key ^ heads)
    key = _mix32(key ^ relative)
    return key.double() / 2**32


@dataclass
class Random(Policy):
    """Keep the ``recent`` newest entries plus ``heavy`` random others (seeded, reproducible).

    Every token gets a fixed pseudo-random key when it is ranked (a hash of ``seed``, its KV head and its position,
    :func:`random_keys`); outside the recent window the entries with the largest keys are kept, so the heavy part
    is a uniformly random subset of all older tokens. The same keys apply in every layer.
    """

    seed: int = 0
    name: ClassVar[str] = "random"
    needs_attention: ClassVar[bool] = False

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        keys = random_keys(self.seed, entries.pos, entries.start)  # float64: no ties among 2**32 values
        return keys.masked_fill(self.recent_window(entries, self.recent), INF)

    def describe(self) -> str:
        return f"{self.name}(heavy={self.heavy}, recent={self.recent}, seed={self.seed})"
