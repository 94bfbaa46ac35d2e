"""The policy registry: every policy's name, class, options and backends, and the one parser of a policy spec.

A spec is ``name[:option=value,...]``, e.g. ``h2o``, ``a2sf:decay=0.95``, ``snapkv:window=16,kernel=5``; every
command's ``--policy`` and the server read it through :func:`parse_policy`. This module imports no torch, so the
command line checks its input (and answers ``--help``) at once; :mod:`h2o_kv.policies` checks at import that its
classes match :data:`REGISTRY`. A new policy is one file under ``policies/`` and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Option:
    """One option of a policy: its type, default and allowed range (``low``/``high``, ``odd``, ``choices``)."""

    name: str
    type: type  # int, float or str
    default: object
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, ...] instead of [low, ...]
    odd: bool = False
    choices: tuple[str, ...] = ()

    @property
    def range(self) -> str:
        """The allowed values in words: ``a number in (0, 1]``, ``an integer >= 1``, ``one of max, avg``."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        what = {int: "an odd integer" if self.odd else "an integer", float: "a number"}[self.type]
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{_text(self.low)}, {_text(self.high)}]"
        return f"{what} {'>' if self.low_open else '>='} {_text(self.low)}" if self.low is not None else what

    def parse(self, text: str) -> object:
        """The value of ``text`` (as typed), or ValueError naming the option and its range."""
        try:
            value = self.type(text.strip())
        except ValueError:
            value = None
        if value is None or not self.allows(value):
            raise ValueError(f"{self.name} must be {self.range}; got {text!r}")
        return value

    def allows(self, value: object) -> bool:
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.type is int and not isinstance(value, int):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return (self.high is None or value <= self.high) and (not self.odd or value % 2 == 1)


def _text(value) -> str:
    return repr(value) if isinstance(value, float) and not value.is_integer() else str(int(value))


# the options of the dataclasses (policies/*.py), by field name
DECAY = Option("decay", float, 0.99, low=0, high=1, low_open=True)  # A2SF's forgetting factor
WINDOW = Option("window", int, 32, low=1)  # observation window (SnapKV's)
KERNEL = Option("kernel", int, 7, low=1, odd=True)  # SnapKV's pooling width
POOLING = Option("pooling", str, "max", choices=("max", "avg"))
SINKS = Option("sinks", int, 4, low=0)
SEED = Option("seed", int, 0, low=0)
ALPHA = Option("alpha", float, 0.2, low=0, high=1)  # Ada-KV's per-head safeguard
ALPHA_0 = Option("alpha", float, 0.0, low=0, high=1)  # ... none by default over all layers (KVzip)
# the share of each head's entries held by the recent window (None: the budget's split, even for a ratio)
RECENT_SHARE = Option("recent_share", float, None, low=0, high=1)
SNAPKV = (WINDOW, KERNEL, POOLING)
DECODE = Option("decode", str, "evict", choices=("evict", "grow"))  # evict while decoding (H2O) or grow (presses)


@dataclass(frozen=True)
class Entry:
    """A registered policy: ``where`` is ``module:Class`` under :mod:`h2o_kv.policies`."""

    where: str
    options: tuple[Option, ...] = ()

    def option(self, name: str) -> Option | None:
        return next((option for option in self.options if option.name == name), None)


# name -> class and options: the one list of policies (in the order commands list them)
REGISTRY: MappingProxyType[str, Entry] = MappingProxyType({
    "h2o": Entry("h2o:H2O"),
    "local": Entry("local:Local"),
    "sink": Entry("sink:Sink", (SINKS,)),
    "full": Entry("full:Full"),
    "tova": Entry("tova:TOVA"),
    "snapkv": Entry("snapkv:SnapKV", SNAPKV),
    "random": Entry("random:Random", (SEED,)),
    "h2o_mean": Entry("h2o:H2OMean"),
    "a2sf": Entry("a2sf:A2SF", (DECAY,)),
    "keydiff": Entry("keydiff:KeyDiff"),
    "window_h2o": Entry("window_h2o:WindowH2O", (WINDOW, DECODE)),
    "ada_h2o": Entry("adakv:AdaH2O", (ALPHA,)),
    "ada_snapkv": Entry("adakv:AdaSnapKV", (*SNAPKV, ALPHA)),
    "ada_window_h2o": Entry("adakv:AdaWindowH2O", (WINDOW, DECODE, ALPHA)),
    "global_h2o": Entry("global_budget:GlobalH2O", (ALPHA_0, RECENT_SHARE)),
    "global_snapkv": Entry("global_budget:GlobalSnapKV", (*SNAPKV, ALPHA_0, RECENT_SHARE)),
    "global_window_h2o": Entry("global_budget:GlobalWindowH2O", (WINDOW, DECODE, ALPHA_0, RECENT_SHARE)),
})  # fmt: skip

POLICY_NAMES: tuple[str, ...] = tuple(REGISTRY)
BOUNDED_POLICIES: tuple[str, ...] = tuple(name for name in POLICY_NAMES if name != "full")
# one budget over all layers needs every layer's scores of a prompt before any layer evicts: transformers backend only
ACROSS_LAYERS: tuple[str, ...] = ("global_h2o", "global_snapkv", "global_window_h2o")
# Ada-KV's per-head budgets (arXiv:2407.11550)
HEAD_ADAPTIVE: tuple[str, ...] = ("ada_h2o", "ada_snapkv", "ada_window_h2o")
# the policies the vLLM backend runs (h2o_kv.vllm.config.ServeConfig refuses the others: its selection is per layer)
SERVER_POLICIES: tuple[str, ...] = tuple(name for name in POLICY_NAMES if name not in ACROSS_LAYERS + HEAD_ADAPTIVE)


@dataclass(frozen=True)
class PolicySpec:
    """A parsed ``--policy``: the name and the options that differ from the defaults (the canonical form, so one
    behaviour has one :attr:`label`)."""

    name: str
    options: dict[str, object] = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        """``name`` or ``name:opt=value,...`` (options in registry order); :func:`parse_policy` reads it back."""
        if not self.options:
            return self.name
        return f"{self.name}:" + ",".join(f"{key}={value}" for key, value in self.options.items())

    @property
    def values(self) -> dict[str, object]:
        """Every option of the policy, defaults included."""
        return {option.name: self.options.get(option.name, option.default) for option in REGISTRY[self.name].options}


def parse_policy(spec: str | PolicySpec, choices: tuple[str, ...] = POLICY_NAMES) -> PolicySpec:
    """The :class:`PolicySpec` of ``name[:option=value,...]``; ValueError (one line, naming the policy or the option
    and what it allows) unless ``name`` is one of ``choices`` and each option is the policy's, in its range."""
    if isinstance(spec, PolicySpec):
        spec = spec.label
    name, colon, rest = str(spec).strip().partition(":")
    name = name.strip()
    if name not in choices:
        raise ValueError(f"policy must be one of {', '.join(choices)}; got {name!r}")
    entry = REGISTRY[name]
    given: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, text = (part.strip() for part in item.partition("="))
        option = entry.option(key)
        if option is None:
            takes = f"takes {', '.join(o.name for o in entry.options)}" if entry.options else "takes no options"
            raise ValueError(f"policy {name} {takes}; got {key!r} (the syntax is {name}:option=value,...)")
        if not sep or not text:
            raise ValueError(f"policy {name}: {key} needs a value ({key}=...), {option.range}")
        if key in given:
            raise ValueError(f"policy {name}: {key} is given twice")
        try:
            given[key] = option.parse(text)
        except ValueError as err:
            raise ValueError(f"policy {name}: {err}") from None
    if colon and not given:
        raise ValueError(f"policy {name}: no options after ':' (the syntax is {name}:option=value,...)")
    options = {o.name: given[o.name] for o in entry.options if o.name in given and given[o.name] != o.default}
    return PolicySpec(name, options)


def options_help(names: tuple[str, ...] = POLICY_NAMES) -> str:
    """The option syntax and the options of the policies ``names`` with their defaults, for a ``--help`` text:
    ``Options as name:option=value,... (e.g. a2sf:decay=0.95), defaults: sinks=4 (sink); ...``."""
    users: dict[tuple[str, object], list[str]] = {}
    for name in names:
        for option in REGISTRY[name].options:
            users.setdefault((option.name, option.default), []).append(name)
    defaults = "; ".join(f"{key}={default} ({', '.join(policies)})" for (key, default), policies in users.items())
    return f"Options as name:option=value,... (e.g. a2sf:decay=0.95), defaults: {defaults}." if users else ""


def split_specs(text: str) -> list[str]:
    """A comma-separated list of settings whose policy specs may hold commas themselves:
    ``"h2o,snapkv:window=16,kernel=5,dynamic"`` -> ``["h2o", "snapkv:window=16,kernel=5", "dynamic"]`` (an item
    ``option=value`` continues the spec before it)."""
    items: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if part and "=" in part and ":" not in part and items and ":" in items[-1]:
            items[-1] += "," + part
        elif part:
            items.append(part)
    return items
