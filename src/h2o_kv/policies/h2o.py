"""H2O: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from .base import INF, EntryView, Policy


@dataclass
class H2O(Policy):
    """Keep the ``recent`` newest entries plus the ``heavy`` entries with the largest accumulated attention.

    A token's score is the running sum of the post-softmax probability it received from every query that saw it
    (all prompt rows causally, then every generated token), summed over the query heads of its KV group; never
    decayed or normalised (the paper's default).

    This class is the specification of H2O's ranking; the fused kernels (``kernels/cpu/decode_step.cpp``, the paged
    ``kernels/cpu/paged_decode.cpp`` of the vLLM backend, the Triton ones) implement exactly this and are tested
    against it (``tests/test_fast_paths.py``, ``tests/serving/test_paged_decode.py``). Per (sequence, KV head), with
    ``seen`` columns seen after the step's token was written:

    1. score update: ``score += mass`` in float32 for every entry (:meth:`accumulate`; a prompt chunk's candidates
       start from 0);
    2. recent window: the entries with ``pos >= seen - recent`` are never evicted (:meth:`keep_score` ranks them
       ``+inf``);
    3. victim (a decode step over full slots, :meth:`~h2o_kv.policies.Policy.decode_victim`): the slot of lowest
       updated score outside the recent window; ties go to the lowest slot index (``min``'s first index), and
       slot 0 when every entry is recent. After a prompt chunk the ``heavy + recent`` best-ranked candidates stay.
    """

    name: ClassVar[str] = "h2o"

    def accumulate(self, scores, mass, last):
        return scores + mass

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        return entries.scores.masked_fill(self.recent_window(entries, self.recent), INF)

    @property
    def fused_h2o_ranking(self) -> bool:
        """True unless a subclass changes :meth:`accumulate` or :meth:`keep_score` (then it is its own ranking)."""
        cls = type(self)
        return cls.accumulate is H2O.accumulate and cls.keep_score is H2O.keep_score

    def decode_victim(self, entries: EntryView, mass, last):
        """With :attr:`fused_h2o_ranking`, one fused pass on the CPU (C++) and CUDA (Triton) (:mod:`h2o_kv.kernels`):
        the mass is added into ``entries.scores`` in place, and those scores are returned."""
        fits = self.fused_h2o_ranking and mass is not None and mass.dtype == entries.scores.dtype == torch.float32
        ops = kernels.step_ops(entries.scores, mass, entries.pos) if fits else None  # kernel dtypes
        if ops is None:
            return super().decode_victim(entries, mass, last)
        return entries.scores, ops.h2o_victim(entries.scores, mass, entries.pos, entries.seen - self.recent)


@dataclass
class H2OMean(H2O):
    """H2O ranked by the *mean* attention a token received instead of the sum (``h2o_mean``; not the paper's default).

    The score is divided by the number of queries that could see the token (``seen - pos``), as kvpress'
    ``ObservedAttentionPress`` does for the prompt, so early tokens are not favoured only for having been seen by
    more queries. Same accumulation and recent window as :class:`H2O`.
    """

    name: ClassVar[str] = "h2o_mean"

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        mean = entries.scores / (entries.seen - entries.pos).clamp_min(1)
        return mean.masked_fill(self.recent_window(entries, self.recent), INF)
