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
    """

    name: ClassVar[str] = "h2o"

    def accumulate(self, scores, mass, last):
        return scores + mass

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        return entries.scores.masked_fill(self.recent_window(entries, self.recent), INF)

    def decode_victim(self, entries: EntryView, mass, last):
        """On the CPU, one fused pass (:mod:`h2o_kv.kernels`): the scores are updated in place.

        Used only where the ranking is exactly H2O's (a subclass that changes ``accumulate`` or ``keep_score`` gets
        the generic composition)."""
        exact = type(self).accumulate is H2O.accumulate and type(self).keep_score is H2O.keep_score
        fits = exact and mass is not None and mass.dtype == entries.scores.dtype == torch.float32  # kernel dtypes
        ops = kernels.cpu_ops(entries.scores, mass, entries.pos) if fits else None
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
