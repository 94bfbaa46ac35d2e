"""Eviction policies: one small dataclass each, registered by name."""

from .a2sf import A2SF
from .adakv import AdaH2O, AdaSnapKV, AdaWindowH2O, HeadAdaptive
from .base import EntryView, Policy
from .full import Full
from .global_budget import AcrossLayers, GlobalH2O, GlobalSnapKV, GlobalWindowH2O
from .h2o import H2O, H2OMean
from .keydiff import KeyDiff
from .local import Local
from .random import Random
from .sink import Sink
from .snapkv import SnapKV
from .tova import TOVA
from .window_h2o import WindowH2O

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        H2O,
        Local,
        Sink,
        Full,
        TOVA,
        SnapKV,
        Random,
        H2OMean,
        A2SF,
        KeyDiff,
        WindowH2O,
        AdaH2O,
        AdaSnapKV,
        AdaWindowH2O,
        GlobalH2O,
        GlobalSnapKV,
        GlobalWindowH2O,
    )
}


def make_policy(name: str, heavy: int, recent: int, **options) -> Policy:
    """Build the policy registered as ``name`` with the given budget split."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None
    return cls(heavy=heavy, recent=recent, **options)


__all__ = [
    "A2SF",
    "AcrossLayers",
    "POLICIES",
    "AdaH2O",
    "AdaSnapKV",
    "AdaWindowH2O",
    "EntryView",
    "Full",
    "GlobalH2O",
    "GlobalSnapKV",
    "GlobalWindowH2O",
    "H2O",
    "H2OMean",
    "HeadAdaptive",
    "KeyDiff",
    "Local",
    "Policy",
    "Random",
    "Sink",
    "SnapKV",
    "TOVA",
    "WindowH2O",
    "make_policy",
]
