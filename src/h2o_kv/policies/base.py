"""The policy contract: a policy only ranks entries; it never touches key/value storage.

A cache layer keeps, per sequence and KV head, a set of entries with their absolute column (``pos``), a
validity flag and a running ``scores`` tensor owned by the policy. After every forward chunk the layer asks
the policy two things:

* :meth:`Policy.accumulate` - fold this chunk's attention into the running scores;
* :meth:`Policy.keep_score` - one number per entry, higher is kept; ``+inf`` marks an entry that must
  survive (recent window, attention sinks).

The layer then keeps the ``capacity`` best entries (after a prompt chunk) or frees the single worst slot
(after a decode step). Adding a method is one small dataclass overriding these two hooks (the shape of
kvpress' ``score()`` presses). A policy may also override :meth:`Policy.decode_victim`, the composition of the
two for a decode step in the steady state, with a fused equivalent (H2O does, on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

INF = float("inf")


@dataclass(frozen=True)
class EntryView:
    """Read-only view of one layer's candidate entries, shapes ``[batch, kv_heads, entries]``."""

    pos: torch.Tensor  # absolute column of each entry in the token stream (int64)
    valid: torch.Tensor  # False for free slots and padding
    scores: torch.Tensor  # the policy's running score (float32)
    seen: int  # columns seen so far, i.e. one past the newest column
    start: torch.Tensor  # [batch] first real (non-pad) column of each sequence


@dataclass
class Policy:
    """Base class. ``heavy + recent`` entries are kept per sequence, layer and KV head."""

    heavy: int = 0
    recent: int = 0

    name: ClassVar[str] = "policy"
    needs_attention: ClassVar[bool] = True  # the attention function must return per-key probability mass
    evicts_during_decode: ClassVar[bool] = True

    @property
    def capacity(self) -> int:
        return self.heavy + self.recent

    def accumulate(self, scores: torch.Tensor, mass: torch.Tensor | None, last: torch.Tensor | None):
        """New running scores given this chunk's summed attention ``mass`` and its last query row ``last``."""
        return scores

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        raise NotImplementedError

    def decode_victim(self, entries: EntryView, mass: torch.Tensor | None, last: torch.Tensor | None):
        """A decode step over full slots: ``(new scores, victim)``, the victim ``[batch, heads, 1]`` being the first
        slot of lowest :meth:`keep_score` after :meth:`accumulate` (an override must give the same result)."""
        scores = self.accumulate(entries.scores, mass, last)
        rank = self.keep_score(replace(entries, scores=scores))
        return scores, rank.min(-1, keepdim=True).indices  # (min: faster than argmin, same first index)

    def recent_window(self, entries: EntryView, size: int) -> torch.Tensor:
        """Mask of the ``size`` most recent columns."""
        return entries.pos >= entries.seen - size

    def describe(self) -> str:
        return f"{self.name}(heavy={self.heavy}, recent={self.recent})"
