"""Statistics and markdown tables for result records, shared by the eval and bench reports.

Every number says what it is: an :class:`Estimate` carries its statistic (``mean``, ``median``, ``paired mean
difference``, ...) and, for means, its standard error, so a table can show ``value ± se`` or a 95% interval and
label means and medians as such. Paired differences compare two settings item by item on the same items (or the
same token blocks), which is much tighter than comparing two unpaired means.

Intervals of means computed here from their items (:func:`mean`, :func:`paired`) are **percentile bootstrap**
intervals (:data:`BOOTSTRAP` resamples of the items, a fixed seed, so a table is reproducible; Efron & Tibshirani,
1993): they stay inside the range the items allow (a paired difference of 0/1 items never runs past -1), where a
normal ``value ± 1.96 se`` does not on a handful of items. :func:`average` over independent groups (tasks, lengths)
averages the groups' resamples, which is the stratified bootstrap. An estimate given only a standard error (e.g.
lm-eval's ``acc_stderr``) keeps the normal interval.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

Z95 = 1.96  # normal quantile of a two-sided 95% interval (estimates known only by a standard error)
BOOTSTRAP = 10_000  # resamples behind the interval of a mean computed from its items
_SEED = 20231  # fixed: the same items give the same interval in every table


@dataclass(frozen=True)
class Estimate:
    """A summary ``value`` of ``n`` numbers, its ``statistic`` and, for means, its standard error ``se``."""

    value: float
    se: float | None = None
    n: int = 1
    statistic: str = "mean"
    # the bootstrap distribution of ``value`` (BOOTSTRAP resampled means), when computed from the items
    resamples: np.ndarray | None = field(default=None, compare=False, repr=False)

    def interval(self, z: float = Z95) -> tuple[float, float] | None:
        """The 95% interval: the bootstrap percentiles where the items were resampled, else the normal
        ``value ± z * se``; ``None`` without either."""
        if self.resamples is not None:
            low, high = np.percentile(self.resamples, [2.5, 97.5])
            return float(low), float(high)
        return None if self.se is None else (self.value - z * self.se, self.value + z * self.se)

    def format(self, scale: float = 1.0, digits: int = 2, *, sign: bool = False, interval: bool = False) -> str:
        """``"12.34 ± 0.56"`` (or ``"12.34 [11.2, 13.4]"`` with ``interval``), every number times ``scale``."""
        spec = f"{'+' if sign else ''}.{digits}f"

        def number(x: float) -> str:  # no "-0.00" for a value that rounds to zero
            x *= scale
            return format(0.0 if abs(x) < 0.5 * 10**-digits else x, spec)

        if self.se is None:
            return number(self.value)
        if interval:
            low, high = self.interval()
            return f"{number(self.value)} [{number(low)}, {number(high)}]"
        return f"{number(self.value)} ± {format(scale * self.se, f'.{digits}f')}"


def _resampled_means(values: Sequence[float]) -> np.ndarray:
    """``BOOTSTRAP`` means of ``values`` resampled with replacement, seeded by the values themselves: reproducible,
    and independent between the groups that :func:`average` combines."""
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng([_SEED, *np.frombuffer(hashlib.sha256(data.tobytes()).digest()[:16], np.uint32)])
    means = np.empty(BOOTSTRAP)
    for start in range(0, BOOTSTRAP, 1000):  # bounded memory for long value lists (perplexity token blocks)
        picks = rng.integers(0, len(data), size=(min(1000, BOOTSTRAP - start), len(data)))
        means[start : start + len(picks)] = data[picks].mean(axis=1)
    return means


def mean(values: Sequence[float]) -> Estimate:
    """The mean, its standard error (sample standard deviation / sqrt(n); 0 for a single value) and its bootstrap
    resamples (the 95% interval)."""
    if not values:
        raise ValueError("no values to average")
    n = len(values)
    value = math.fsum(values) / n
    var = math.fsum((v - value) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return Estimate(value, math.sqrt(var / n), n, "mean", _resampled_means(values))


def paired(values: Sequence[float], base: Sequence[float]) -> Estimate:
    """The mean of the item-by-item differences ``values - base``, its standard error and the paired bootstrap
    (items resampled with both settings' values together)."""
    if len(values) != len(base):
        raise ValueError(f"paired comparison needs the same items: {len(values)} vs {len(base)} values")
    diff = mean([a - b for a, b in zip(values, base, strict=True)])
    return Estimate(diff.value, diff.se, diff.n, "paired mean difference", diff.resamples)


def average(estimates: Sequence[Estimate]) -> Estimate:
    """The unweighted mean of independent estimates (e.g. over tasks), its standard error combined in quadrature."""
    if not estimates:
        raise ValueError("no estimates to average")
    k = len(estimates)
    value = math.fsum(e.value for e in estimates) / k
    se = None if any(e.se is None for e in estimates) else math.sqrt(math.fsum(e.se**2 for e in estimates)) / k
    resamples = None  # the stratified bootstrap: each group resampled on its own, the groups' resamples averaged
    if all(e.resamples is not None for e in estimates):
        resamples = np.mean([e.resamples for e in estimates], axis=0)
    return Estimate(value, se, sum(e.n for e in estimates), f"average of {k} {estimates[0].statistic}s", resamples)


def over_groups(groups: Sequence[Sequence[float]], statistic: str = "mean") -> Estimate:
    """The unweighted mean over groups (e.g. tasks) of each group's mean of items (or of paired differences).

    With groups of equal size (a suite of ``n`` items per task) that is the mean of all items, and its interval
    resamples all items together: a stratified bootstrap of two items per task would be far too narrow. Groups of
    unequal size are resampled each on its own (:func:`average`)."""
    if not groups or any(not group for group in groups):
        raise ValueError("no values to average in some group")
    if len({len(group) for group in groups}) > 1:
        return average([mean(group) for group in groups])
    pooled = mean([value for group in groups for value in group])
    return Estimate(pooled.value, pooled.se, pooled.n, f"average of {len(groups)} {statistic}s", pooled.resamples)


def median(values: Sequence[float]) -> Estimate:
    """The median (no standard error: reported as a median, e.g. of repeated timings)."""
    if not values:
        raise ValueError("no values for a median")
    return Estimate(statistics.median(values), None, len(values), "median")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values`` (``nan`` for none)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]], *, first_left: bool = True) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned (numbers)."""
    align = ["---" if first_left and i == 0 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines
