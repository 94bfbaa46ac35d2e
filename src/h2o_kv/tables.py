"""Statistics and markdown tables for result records, shared by the eval and bench reports.

Every number says what it is: an :class:`Estimate` carries its statistic (``mean``, ``median``, ``paired mean
difference``, ...) and, for means, its standard error, so a table can show ``value ± se`` or a 95% interval and
label means and medians as such. Paired differences compare two settings item by item on the same items (or the
same token blocks), which is much tighter than comparing two unpaired means.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.96  # normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class Estimate:
    """A summary ``value`` of ``n`` numbers, its ``statistic`` and, for means, its standard error ``se``."""

    value: float
    se: float | None = None
    n: int = 1
    statistic: str = "mean"

    def interval(self, z: float = Z95) -> tuple[float, float] | None:
        """The normal ``value ± z * se`` interval (95% by default); ``None`` without a standard error."""
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


def mean(values: Sequence[float]) -> Estimate:
    """The mean and its standard error (sample standard deviation / sqrt(n); 0 for a single value)."""
    if not values:
        raise ValueError("no values to average")
    n = len(values)
    value = math.fsum(values) / n
    var = math.fsum((v - value) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return Estimate(value, math.sqrt(var / n), n, "mean")


def paired(values: Sequence[float], base: Sequence[float]) -> Estimate:
    """The mean of the item-by-item differences ``values - base`` and its standard error."""
    if len(values) != len(base):
        raise ValueError(f"paired comparison needs the same items: {len(values)} vs {len(base)} values")
    diff = mean([a - b for a, b in zip(values, base, strict=True)])
    return Estimate(diff.value, diff.se, diff.n, "paired mean difference")


def average(estimates: Sequence[Estimate]) -> Estimate:
    """The unweighted mean of independent estimates (e.g. over tasks), its standard error combined in quadrature."""
    if not estimates:
        raise ValueError("no estimates to average")
    k = len(estimates)
    value = math.fsum(e.value for e in estimates) / k
    se = None if any(e.se is None for e in estimates) else math.sqrt(math.fsum(e.se**2 for e in estimates)) / k
    return Estimate(value, se, sum(e.n for e in estimates), f"average of {k} {estimates[0].statistic}s")


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
