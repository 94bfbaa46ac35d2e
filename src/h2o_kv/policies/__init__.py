"""Eviction policies: one small dataclass each, registered by name."""

from .base import EntryView, Policy
from .full import Full
from .h2o import H2O, H2OMean
from .local import Local
from .random import Random
from .sink import Sink
from .snapkv import SnapKV
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (H2O, Local, Sink, Full, TOVA, SnapKV, Random, H2OMean)}


def make_policy(name: str, heavy: int, recent: int, **options) -> Policy:
    """Build the policy registered as ``name`` with the given budget split."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None
    return cls(heavy=heavy, recent=recent, **options)


__all__ = [
    "POLICIES",
    "EntryView",
    "Full",
    "H2O",
    "H2OMean",
    "Local",
    "Policy",
    "Random",
    "Sink",
    "SnapKV",
    "TOVA",
    "make_policy",
]
