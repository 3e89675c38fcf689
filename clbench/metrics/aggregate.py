"""Aggregation: mean, spread and count over seeds; bootstrap intervals over evaluation items.

A single seed is not a result: every summary carries ``n`` and the formatted form always shows
it (``0.53 (n=1)``), so a one-seed number can never pass for a mean over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def format_value(value: float, digits: int = 3) -> str:
    """`value` to `digits` decimals, without the sign of a value that rounds to zero (a FWT of
    -0.0001 reads 0.000, not -0.000)."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


@dataclass(frozen=True)
class SeedSummary:
    """Mean and sample standard deviation (ddof=1) of one quantity over ``n`` seeds.

    ``std`` is ``None`` for n = 1 (a spread needs two samples); ``n`` counts defined values
    only, ``missing`` the seeds where the quantity was undefined.
    """

    mean: float | None
    std: float | None
    n: int
    missing: int = 0

    def format(self, digits: int = 3) -> str:
        """``0.532 ± 0.021 (n=3)``; ``0.532 (n=1)``; ``n/a (n=0)``."""
        if self.mean is None:
            text = "n/a"
        elif self.std is None:
            text = format_value(self.mean, digits)
        else:
            text = f"{format_value(self.mean, digits)} ± {format_value(self.std, digits)}"
        return f"{text} (n={self.n})"

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n, "missing": self.missing}


def summarise(values: Iterable[float | None]) -> SeedSummary:
    """Summary of one quantity over seeds; ``None`` and NaN values are counted as missing."""
    vals = list(values)
    defined = [float(v) for v in vals if v is not None and not math.isnan(float(v))]
    missing = len(vals) - len(defined)
    if not defined:
        return SeedSummary(None, None, 0, missing)
    mean = float(np.mean(defined))
    std = float(np.std(defined, ddof=1)) if len(defined) > 1 else None
    return SeedSummary(mean, std, len(defined), missing)


def mean_of_numbers(values: Iterable[Any]) -> float | None:
    """The mean of the values that are numbers (None, NaN and anything else left out); None
    when there is none."""
    return summarise(v for v in values
                     if isinstance(v, (int, float)) and not isinstance(v, bool)).mean


def aggregate_over_seeds(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, SeedSummary]]:
    """``{method: {metric: SeedSummary}}`` from run records.

    Each record is ``{"method": str, "seed": int, "metrics": {name: {"value": ...}}}`` (the
    shape of `results.json` reduced to what aggregation needs). Duplicate (method, seed) pairs
    are refused: they would count one seed twice.
    """
    by_method: dict[str, dict[int, Mapping[str, Any]]] = {}
    for run in runs:
        seeds = by_method.setdefault(run["method"], {})
        if run["seed"] in seeds:
            raise ValueError(f"method {run['method']!r} has two runs with seed {run['seed']}; "
                             "each seed must be counted once")
        seeds[run["seed"]] = run["metrics"]
    out: dict[str, dict[str, SeedSummary]] = {}
    for method, seeds in by_method.items():
        names: list[str] = []
        for metrics in seeds.values():
            names += [n for n in metrics if n not in names]
        out[method] = {name: summarise(_value(metrics.get(name)) for metrics in seeds.values())
                       for name in names}
    return out


def _value(entry: Any) -> float | None:
    if entry is None:
        return None
    if isinstance(entry, Mapping):
        entry = entry.get("value")
    return None if entry is None or isinstance(entry, (list, dict)) else float(entry)


@dataclass(frozen=True)
class Interval:
    """An interval of a mean over items, and how it was made."""

    low: float
    high: float
    confidence: float
    samples: int = 0  # bootstrap resamples (0: a closed form)
    method: str = "percentile bootstrap over items"

    def as_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "confidence": self.confidence,
                "samples": self.samples, "method": self.method}


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> Interval | None:
    """The Wilson score interval of a proportion `successes / n` (None for no items).

    A cell of R is a fraction of items correct. Its percentile bootstrap is [0, 0] for a cell
    at 0 and [1, 1] at 1 (every resample of all-wrong items is all wrong), as if a hundred
    items had measured the rate exactly; Wilson's interval keeps a width there (0 of 100:
    [0, 0.037]) and stays inside [0, 1], with coverage near its nominal level for small n."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"{successes} successes out of {n}")
    z = float(np.sqrt(2.0) * _erfinv(confidence))
    p = successes / n
    denominator = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / denominator
    return Interval(max(0.0, centre - half), min(1.0, centre + half), confidence,
                    method="Wilson score")


def _erfinv(y: float) -> float:
    """The inverse error function, by Newton's method on math.erf (no scipy needed)."""
    x = 0.0
    for _ in range(60):
        step = (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
        x -= step
        if abs(step) < 1e-15:
            break
    return x


# Student's t, two-sided 95%: t_{0.975, df} for df = 1..30 (beyond: the normal's 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def seed_interval(summary: SeedSummary) -> tuple[float, float] | None:
    """The 95% Student-t interval of the mean over seeds, mean ± t * std / sqrt(n); None for
    fewer than two seeds (a spread needs two)."""
    if summary.mean is None or summary.std is None or summary.n < 2:
        return None
    t = _T975[summary.n - 2] if summary.n - 1 <= len(_T975) else 1.96
    half = t * summary.std / math.sqrt(summary.n)
    return summary.mean - half, summary.mean + half
