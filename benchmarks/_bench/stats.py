"""Statistics of repeated measurements (pure functions; no torch, no I/O)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def median_spread(xs: Sequence[float], digits: int = 2) -> str:
    """``median [min-max]`` of ``xs``; NaN (a run that did not happen) is left out; ``-`` if empty."""
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics, as numpy's default)."""
    if not xs:
        raise ValueError("quantile of no samples")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Overhead:
    """A relative overhead (0.05 is +5%) with its confidence interval."""

    estimate: float
    low: float
    high: float

    @property
    def within_noise(self) -> bool:
        """The interval holds 0: this run cannot tell the contender from the baseline."""
        return self.low <= 0.0 <= self.high

    def __str__(self) -> str:
        ci = f"95% CI {self.low * 100:+.1f}% to {self.high * 100:+.1f}%"
        if self.within_noise:
            return f"within noise ({ci})"
        return f"{self.estimate * 100:+.1f}% ({ci})"


def overhead(base: Sequence[float], other: Sequence[float], *, level: float = 0.95, resamples: int = 4000,
             seed: int = 0) -> Overhead:
    """The overhead of ``other`` over ``base``, paired by round (``base[i]`` and ``other[i]`` were
    measured in the same round): the median of the ratios ``other[i] / base[i]``, minus 1, with a
    bootstrap percentile interval (rounds resampled with replacement; seeded, so the same samples
    give the same interval)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"overhead needs paired rounds, got {len(base)} and {len(other)}")
    ratios = [o / b for o, b in zip(other, base)]
    rng = random.Random(seed)
    boot = [statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)]
    tail = (1 - level) / 2
    return Overhead(statistics.median(ratios) - 1, quantile(boot, tail) - 1, quantile(boot, 1 - tail) - 1)
