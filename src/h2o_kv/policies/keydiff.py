"""KeyDiff: key similarity-based eviction (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import INF, EntryView, Policy


@dataclass
class KeyDiff(Policy):
    """Keep the keys that differ most from the head's mean direction; no attention probabilities needed.

    Per KV head the anchor is the mean of the L2-normalised keys of the valid entries (the candidates after a
    prompt chunk, the slots at a decode step); an entry's score is ``-cos(key, anchor)``, so keys unlike the
    average are kept. The ``recent`` newest entries are protected as in H2O. It evicts at every decode step with the
    anchor of the current cache. Keys are what :class:`~h2o_kv.policies.EntryView` carries: rotated at their
    positions, or position-free (before RoPE) in the transformers backend's streaming mode.
    """

    name: ClassVar[str] = "keydiff"
    needs_attention: ClassVar[bool] = False
    needs_keys: ClassVar[bool] = True

    def keep_score(self, entries: EntryView) -> torch.Tensor:
        unit = F.normalize(entries.keys.float(), dim=-1)
        weight = entries.valid.unsqueeze(-1).to(unit.dtype)
        anchor = (unit * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1)
        score = -(unit * anchor).sum(-1) / anchor.norm(dim=-1).clamp_min(1e-12)
        return score.masked_fill(self.recent_window(entries, self.recent), INF)
