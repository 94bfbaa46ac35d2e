"""Eviction policies: one small dataclass each, registered by name and options in :mod:`h2o_kv.registry`."""

import dataclasses
from importlib import import_module

from ..registry import ACROSS_LAYERS, HEAD_ADAPTIVE, REGISTRY, PolicySpec, parse_policy
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


def _registered() -> dict[str, type[Policy]]:
    """The classes of :data:`h2o_kv.registry.REGISTRY`, checked against it: the class's ``name``, its option fields
    (beyond ``heavy``/``recent``) with their defaults, and whether it spans layers or heads are the registry's."""
    classes = {}
    for name, entry in REGISTRY.items():
        module, _, qualname = entry.where.partition(":")
        cls = getattr(import_module(f"{__name__}.{module}"), qualname)
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("heavy", "recent")}
        declared = {option.name: option.default for option in entry.options}
        kinds = (cls.across_layers, cls.head_adaptive and not cls.across_layers)
        if cls.name != name or fields != declared or kinds != (name in ACROSS_LAYERS, name in HEAD_ADAPTIVE):
            raise TypeError(f"h2o_kv.registry: {name} is {cls.__name__}(name={cls.name!r}, options {fields}), "
                            f"registered with options {declared}")  # fmt: skip
        classes[name] = cls
    return classes


POLICIES: dict[str, type[Policy]] = _registered()


def make_policy(spec: str | PolicySpec, heavy: int, recent: int, **options) -> Policy:
    """Build the policy of ``spec`` (a registered name, or ``name:option=value,...``, :func:`~h2o_kv.registry.
    parse_policy`) with the given budget split; keyword ``options`` override the spec's."""
    spec = parse_policy(spec)
    return POLICIES[spec.name](heavy=heavy, recent=recent, **{**spec.options, **options})


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
