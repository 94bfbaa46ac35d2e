"""The policy contract, shared by both backends: a policy only ranks entries; it never touches storage or queries.

A backend keeps, per sequence, layer and KV head, a set of entries: their keys and values plus the absolute column
of each (``pos``), a validity flag and a running score owned by the policy. After every attention call it asks the
policy two things, through an :class:`EntryView`:

* :meth:`Policy.accumulate` - fold the attention this call paid (``mass``: probability summed over the call's query
  rows and the query heads of each KV group; ``last``: the same over the last :attr:`Policy.observation_window`
  rows only) into the running scores;
* :meth:`Policy.keep_score` - one number per entry, higher is kept; ``+inf`` marks an entry that must survive
  (recent window, attention sinks).

It then keeps the :attr:`Policy.capacity` best entries (after a prompt chunk; :meth:`Policy.select`, per KV head
unless the policy is :attr:`~Policy.head_adaptive`; once every layer has scored the prompt when it is
:attr:`~Policy.across_layers`, i.e. at layer 0 of the next forward in the transformers backend) or frees the single
worst one (after a decode step). Adding a method is one small dataclass overriding these two hooks (the shape of
kvpress' ``score()`` presses) and one line in the registry (:data:`h2o_kv.registry.REGISTRY`).

:meth:`Policy.decode_victim` is the composition of the two for a decode step over full slots. Where
:attr:`Policy.fused_h2o_ranking` is true (H2O's exact ranking, :class:`~h2o_kv.policies.H2O`), a backend may run a
fused kernel of that ranking instead - the transformers cache through :meth:`~h2o_kv.policies.H2O.decode_victim`,
the vLLM backend in its paged decode kernel; a policy never knows which backend runs it. A backend reads nothing of
a policy beyond :data:`BACKEND_CONTRACT`.

Ownership: an :class:`EntryView` is read-only for :meth:`~Policy.accumulate`, :meth:`~Policy.keep_score` and
:meth:`~Policy.select`, which return new tensors. :meth:`~Policy.decode_victim` owns the score update of its step: it
may write the new scores into ``entries.scores`` in place (the fused H2O path does) and returns the scores the
backend stores from then on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

INF = float("inf")

# What a backend may read of a policy (tests/test_contract.py checks the transformers and the vLLM backend use no
# more): its budget, what it needs computed, how it selects, and the hooks.
BACKEND_CONTRACT = frozenset({
    "heavy", "recent", "capacity", "bounded", "name", "describe",  # the budget and its label
    "needs_attention", "needs_keys", "observation_window", "evicts_during_decode",  # what the backend computes
    "head_adaptive", "across_layers", "fused_h2o_ranking",  # how the backend may select
    "accumulate", "keep_score", "select", "select_layers", "decode_victim",  # the hooks
})  # fmt: skip


@dataclass(frozen=True)
class EntryView:
    """View of one layer's entries, shapes ``[batch, kv_heads, entries]`` (``keys``: ``[..., head_dim]``); read-only
    except ``scores`` in :meth:`Policy.decode_victim` (see the module docstring).

    ``keys`` are what attention reads: rotated at their absolute positions (RoPE models), except in the
    transformers backend's streaming mode, where they are stored before RoPE (position-free). They are ``None``
    unless the policy sets :attr:`Policy.needs_keys`.
    """

    pos: torch.Tensor  # absolute column of each entry in the token stream (int64)
    valid: torch.Tensor  # False for free slots and padding
    scores: torch.Tensor  # the policy's running score (float32)
    seen: int  # columns seen so far, i.e. one past the newest column
    start: torch.Tensor  # [batch] first real (non-pad) column of each sequence
    keys: torch.Tensor | None = None


@dataclass
class Policy:
    """Base class. ``heavy + recent`` entries are kept per sequence, layer and KV head."""

    heavy: int = 0
    recent: int = 0

    name: ClassVar[str] = "policy"
    needs_attention: ClassVar[bool] = True  # the backend must compute per-key probability mass
    needs_keys: ClassVar[bool] = False  # the EntryView must carry the keys
    evicts_during_decode: ClassVar[bool] = True  # False: compress the prompt once, then let the cache grow
    head_adaptive: ClassVar[bool] = False  # True: select() shares the layer's budget across its KV heads
    across_layers: ClassVar[bool] = False  # True: select_layers() shares the model's budget across all layers

    @property
    def capacity(self) -> float:
        """Entries kept after every step (``inf`` for an unbounded policy)."""
        return self.heavy + self.recent

    @property
    def bounded(self) -> bool:
        """Whether this policy ever evicts (``full`` does not)."""
        return math.isfinite(self.capacity)

    @property
    def fused_h2o_ranking(self) -> bool:
        """Whether this policy's decode step is exactly H2O's ranking (:class:`~h2o_kv.policies.H2O`, the
        specification), so that a backend may run a fused kernel of it instead of the hooks."""
        return False

    @property
    def observation_window(self) -> int:
        """How many of a call's last query rows make up ``last`` (1: the newest query; SnapKV: its window)."""
        return 1

    def accumulate(self, scores: torch.Tensor, mass: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor:
        """New running scores given this call's ``mass`` and ``last`` (see the module docstring)."""
        return scores

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        raise NotImplementedError

    def select(self, rank: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The entries a prompt chunk keeps, from ``rank`` ``[batch, heads, n]`` (``-inf``: invalid): ``(index,
        counts)``, ``index [batch, heads, width]`` and ``counts [batch, heads]`` entries of each row of ``index``
        being kept (``None``: all ``width == keep`` of them, the per-head rule)."""
        return rank.topk(keep, dim=-1).indices, None

    def decode_victim(self, entries: EntryView, mass: torch.Tensor | None, last: torch.Tensor | None):
        """A decode step over full slots: ``(new scores, victim)``, the victim ``[batch, heads, 1]`` being the first
        slot of lowest :meth:`keep_score` after :meth:`accumulate` (an override must give the same result). The
        caller keeps the returned scores; ``entries.scores`` may have been updated in place."""
        scores = self.accumulate(entries.scores, mass, last)
        rank = self.keep_score(replace(entries, scores=scores))
        return scores, rank.min(-1, keepdim=True).indices  # (min: faster than argmin, same first index)

    def recent_window(self, entries: EntryView, size: int) -> torch.Tensor:
        """Mask of the ``size`` most recent columns."""
        return entries.pos >= entries.seen - size

    def describe(self) -> str:
        return f"{self.name}(heavy={self.heavy}, recent={self.recent})"
