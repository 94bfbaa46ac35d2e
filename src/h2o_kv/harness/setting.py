"""One KV setting: which cache a run uses, shared by the evaluations, the bench and the kvpress peer.

A setting is one of, named distinctly in every result:

* ``dynamic`` - transformers' stock ``DynamicCache``: the model as shipped.
* an h2o-kv policy at a :class:`~h2o_kv.Budget` - ``H2OCache(policy=name)``, named by its spec (``h2o``,
  ``a2sf:decay=0.95``: :func:`h2o_kv.registry.parse_policy`; options at their defaults are not written, so a record
  without options is the defaults). ``full`` is the same frame without
  eviction (h2o-kv's attention function and slot storage, nothing ever evicted): a *different* baseline from
  ``dynamic``, numerically equal to it up to float rounding but with h2o-kv's speed and memory.
* ``kvpress:<press>`` - an NVIDIA kvpress press (:mod:`h2o_kv.harness.peers`) compressing a ``DynamicCache`` once, after
  the prefill, to the entry count the same budget gives.

Any setting but a press may store its KV entries quantized (``kv_bits`` 4 or 8): an h2o-kv policy as
``H2OCache(kv_bits=...)`` (:mod:`h2o_kv.hf.quant`), ``dynamic`` as transformers' own ``QuantizedCache`` (the peer,
quanto backend, 4-bit only, group 64, the same full-precision residual length as h2o-kv's ring).

An h2o-kv policy may score its prompt by a context-reconstruction pass (``reconstruct``: ``sum`` or ``max`` of its
attention, KVzip's signal: :mod:`h2o_kv.hf.reconstruct`); the setting is then labelled ``<policy>+rec`` or
``<policy>+recmax``.

Whether a setting evicts comes from the policy object (:attr:`Policy.bounded`), never from its name; a bounded
setting needs a budget, an unbounded one takes none. Entry counts come from :meth:`Budget.entries` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..budget import Budget
from ..registry import POLICY_NAMES, PolicySpec, parse_policy

DYNAMIC = "dynamic"
PRESS_PREFIX = "kvpress:"


def setting_names(presses: bool = True) -> list[str]:
    """Every setting name: ``dynamic``, the registered policies, ``kvpress:<press>`` (unless not ``presses``)."""
    from .peers import PRESSES

    return [DYNAMIC, *POLICY_NAMES, *(PRESS_PREFIX + press for press in PRESSES if presses)]


def check_name(name: str, option: str = "setting", presses: bool = True) -> str:
    """The canonical name of setting ``name`` (a policy spec with its options, :func:`~h2o_kv.registry.
    parse_policy`); ``ValueError`` naming ``option`` otherwise (``presses=False``: presses are refused)."""
    name = str(name).strip()
    if name.partition(":")[0] in POLICY_NAMES:
        try:
            return parse_policy(name).label
        except ValueError as err:  # "policy a2sf: decay must be ..." -> "--policy a2sf: decay must be ..."
            raise ValueError(option + str(err).removeprefix("policy")) from None
    if name not in setting_names(presses):
        raise ValueError(f"{option} must be one of {', '.join(setting_names(presses))}; got {name!r}")
    return name


def is_bounded(name: str) -> bool:
    """Whether setting ``name`` evicts anything: the policy object's :attr:`~h2o_kv.Policy.bounded`; a press always;
    ``dynamic`` never."""
    name = check_name(name)
    if name.startswith(PRESS_PREFIX):
        return True
    if name == DYNAMIC:
        return False
    from ..policies import make_policy

    return make_policy(name, 0, 0).bounded


@dataclass(frozen=True)
class KVSetting:
    """A named cache and, when it evicts, its budget. Build it with :meth:`of` (user options)."""

    name: str
    budget: Budget | None = None
    kv_bits: int | None = None
    reconstruct: str | None = None  # the statistic of a reconstruction pass: "sum" or "max"

    def __post_init__(self):
        object.__setattr__(self, "name", check_name(self.name))  # the canonical spec: one behaviour, one name
        from ..hf.cache import STATISTICS

        if self.reconstruct is not None and self.reconstruct not in STATISTICS:
            raise ValueError(f"reconstruct must be one of {', '.join(STATISTICS)}; got {self.reconstruct!r}")
        if self.reconstruct and not (self.uses_h2o_cache and self.bounded and self.kv_bits is None):
            raise ValueError(
                f"reconstruct: a context-reconstruction pass scores the prompt for a bounded h2o-kv policy in full "
                f"precision; not for {self.label}"
            )
        from ..hf.quant import check_bits

        check_bits(self.kv_bits)
        if self.kv_bits is not None and self.press is not None:
            raise ValueError(f"kv_bits: {self.name} compresses a DynamicCache; quantized storage is not offered there")
        if self.kv_bits not in (None, 4) and self.name == DYNAMIC:
            raise ValueError(
                f"kv_bits: dynamic runs transformers' QuantizedCache (quanto), 4-bit only; got {self.kv_bits}"
            )
        if self.bounded and self.budget is None:
            raise ValueError(f"{self.name} evicts: give budget (a ratio in (0, 1] of the prompt) or heavy and recent")
        if not self.bounded and self.budget is not None:
            raise ValueError(f"{self.name} keeps every entry: give no budget, heavy or recent")

    @classmethod
    def of(
        cls,
        name: str,
        *,
        budget: float | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        option: str = "setting",
        kv_bits: int | None = None,
        reconstruct: str | None = None,
    ) -> KVSetting:
        """The setting ``name`` with the budget of the user options (none for an unbounded setting); errors name
        ``option`` (e.g. ``--policy``) for a bad name."""
        name = check_name(name, option)
        given = budget is not None or heavy is not None or recent is not None
        return cls(name, Budget.of(budget, heavy, recent) if given else None, kv_bits, reconstruct)

    @property
    def press(self) -> str | None:
        """The kvpress press name of a ``kvpress:<press>`` setting."""
        return self.name[len(PRESS_PREFIX) :] if self.name.startswith(PRESS_PREFIX) else None

    @property
    def uses_h2o_cache(self) -> bool:
        """Whether the setting runs an :class:`~h2o_kv.H2OCache` (else a stock ``DynamicCache``)."""
        return self.name.partition(":")[0] in POLICY_NAMES

    @property
    def spec(self) -> PolicySpec | None:
        """The h2o-kv policy and its options (None for ``dynamic`` and presses)."""
        return parse_policy(self.name) if self.uses_h2o_cache else None

    @property
    def bounded(self) -> bool:
        return is_bounded(self.name)

    def entries(self, prompt_length: int) -> int:
        """KV entries per layer and KV head kept after a ``prompt_length``-token prompt (all of it if unbounded)."""
        return self.budget.entries(prompt_length) if self.bounded else prompt_length

    def missing_extra(self) -> str | None:
        """The pip extra this setting needs and this environment lacks, or None: ``quant-peer`` for ``dynamic`` with
        ``kv_bits`` (transformers' quanto ``QuantizedCache``), ``peers`` for a kvpress press. Commands check every
        setting before any work."""
        if self.kv_bits is not None and not self.uses_h2o_cache and not _installed("optimum.quanto"):
            return "quant-peer"
        if self.press is not None and not _installed("kvpress"):
            return "peers"
        return None

    def require_extras(self, option: str = "--policy") -> None:
        """Raise a one-line ``ValueError`` naming the extra :meth:`missing_extra` finds missing."""
        extra = self.missing_extra()
        if extra is not None:
            what = "transformers' QuantizedCache (optimum-quanto)" if extra == "quant-peer" else "kvpress"
            raise ValueError(f"{option}: {self.label} runs {what}, which is not installed here: "
                             f"pip install -e '.[{extra}]'")  # fmt: skip

    def make_cache(self, *, prompt_length: int | None = None, stepwise: bool = False, config=None, **options):
        """A fresh cache: ``DynamicCache`` (``dynamic``, presses; laid out for the model ``config`` when given) or
        ``H2OCache`` with this budget, a ratio budget resolved against ``prompt_length`` when given (else against the
        first forward, H2OCache's own rule); ``options`` go to ``H2OCache`` (``streaming``, policy options, ...)."""
        if self.kv_bits is not None and not self.uses_h2o_cache:
            return quantized_peer_cache(config, self.kv_bits)
        if self.kv_bits is not None:
            options = {"kv_bits": self.kv_bits, **options}
        if not self.uses_h2o_cache:
            from transformers import DynamicCache

            return DynamicCache() if config is None else DynamicCache(config=config)
        from ..hf.cache import H2OCache

        spec = self.spec
        options = {**spec.options, **options}
        budget = self.budget
        if budget is None:
            return H2OCache(policy=spec.name, stepwise=stepwise, **options)
        if budget.is_ratio and prompt_length is None:
            return H2OCache(budget=budget.ratio, policy=spec.name, stepwise=stepwise, **options)
        heavy, recent = budget.split(prompt_length or 0)
        return H2OCache(heavy, recent, policy=spec.name, stepwise=stepwise, **options)

    def fields(self) -> dict[str, Any]:
        """The result-record fields of this setting (``policy``: the name with its non-default options, e.g.
        ``a2sf:decay=0.95``; ``budget`` 1.0 and no counts when nothing is evicted; ``kv_bits`` only when quantized
        and ``reconstruct`` only when set, so the records and item logs of earlier runs are unchanged and resume)."""
        budget = self.budget
        fields = {
            "policy": self.name,
            "bounded": self.bounded,
            "budget": budget.ratio if budget is not None else 1.0,
            "heavy": None if budget is None else budget.heavy,
            "recent": None if budget is None else budget.recent,
            "peer": self.press is not None,
        }
        if self.kv_bits is not None:
            fields["kv_bits"] = self.kv_bits
        if self.reconstruct:
            fields["reconstruct"] = self.reconstruct
        return fields

    def describe(self) -> str:
        bits = "" if self.kv_bits is None else f" + {self.kv_bits}-bit KV"
        bits += f" + reconstruction scoring ({self.reconstruct})" if self.reconstruct else ""
        return (self.name if self.budget is None else f"{self.name} ({self.budget.describe()})") + bits

    @property
    def label(self) -> str:
        """The setting's name with its KV precision and scoring, for file names and tables: ``h2o``, ``h2o-kv4``,
        ``snapkv+rec`` (reconstruction scoring, sum), ``snapkv+recmax``, ``a2sf:decay=0.95``."""
        label = self.name if self.kv_bits is None else f"{self.name}-kv{self.kv_bits}"
        return label + {None: "", "sum": "+rec", "max": "+recmax"}[self.reconstruct]


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def quantized_peer_cache(config, kv_bits: int = 4):
    """transformers' ``QuantizedCache`` (quanto backend, ``kv_bits`` bits, group 64, the newest
    ``DEFAULT_RESIDUAL`` tokens kept in full precision as h2o-kv's ring): the peer of ``H2OCache(kv_bits=...)``."""
    from transformers import QuantizedCache

    from ..hf.quant import DEFAULT_GROUP, DEFAULT_RESIDUAL

    if config is None:
        raise ValueError("the QuantizedCache peer needs the model config (make_cache(config=model.config))")
    return QuantizedCache("quanto", config, nbits=kv_bits, q_group_size=DEFAULT_GROUP, residual_length=DEFAULT_RESIDUAL)


def held_entries(cache) -> int:
    """The most KV entries any layer, sequence and KV head of ``cache`` holds (``H2OCache`` or ``DynamicCache``)."""
    if hasattr(cache, "kept_entries"):
        return cache.kept_entries()
    return cache.get_seq_length()


def mean_entries(cache) -> int:
    """KV entries per layer, sequence and KV head of ``cache``, averaged over them and rounded (what ``kept`` in an
    evaluation record means: a global or head-adaptive policy holds unequal counts, kvpress' presses the same)."""
    if hasattr(cache, "mean_entries"):
        return round(cache.mean_entries())
    return cache.get_seq_length()
