"""Honest ranks: entries share a rank unless their results separate them.

Each entry's index metrics are redrawn by the seed-and-item bootstrap of `clbench report
--compare` (:mod:`clbench.report.pairwise`: seeds resampled, every cell's items redrawn, the
metrics computed from the redrawn matrix as a run computes them). Per metric:

- each entry's 95% interval of its mean (`item_low`, `item_high`), shown in its cell so that
  sorting by any column keeps it in view;
- entry A is **ahead** of entry B when the 95% interval of A - B (in the metric's better
  direction) leaves out 0;
- an entry's **rank** (by ACC) is 1 + the number of entries ahead of it, so entries that no
  entry separates share a rank (the convention of rating leaderboards with intervals);
- the **best** mark of a metric goes to an entry ahead of every other entry, and to none when
  no entry is.

The draws come from a fixed seed, so a rebuild gives the same ranks and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clbench.report.pairwise import bootstrap_draws
from clbench.results import RunResult

#: Bootstrap draws per entry (the intervals' percentiles are stable to about 0.005 at this n).
SAMPLES = 1000
CONFIDENCE = 0.95
RANKED_BY = "acc"


def rank_entries(entries: list[dict[str, Any]], runs: dict[str, Sequence[RunResult]],
                 metrics: Sequence[str]) -> None:
    """Set each entry's `rank`, `tied` (another entry has its rank), every metric's
    `item_low`/`item_high` and `best` (ahead of every other entry), in place; `runs` holds
    each entry's results by entry id."""
    rng = np.random.default_rng(0)
    raw = {e["id"]: bootstrap_draws(runs[e["id"]], list(metrics), SAMPLES, rng) for e in entries}
    tail = (1 - CONFIDENCE) / 2
    for e in entries:
        e["rank"] = None  # unranked until its ACC is compared (none has one: none is ranked)
        for name, summary in e["metrics"].items():
            values = raw[e["id"]].get(name)
            values = values[~np.isnan(values)] if values is not None else np.array([])
            low, high = np.quantile(values, [tail, 1 - tail]) if values.size else (None, None)
            summary["item_low"] = None if low is None else float(low)
            summary["item_high"] = None if high is None else float(high)
            summary["best"] = False
    draws = {e["id"]: _with_means(e, raw[e["id"]]) for e in entries}
    for name in metrics:
        scored = [e for e in entries if e["metrics"].get(name, {}).get("mean") is not None]
        if not scored:
            continue
        higher = scored[0]["metrics"][name]["higher_is_better"]
        ahead = {e["id"]: {o["id"] for o in scored
                           if o is not e and _ahead(draws[o["id"]][name], draws[e["id"]][name],
                                                    higher, tail)}
                 for e in scored}
        if name == RANKED_BY:
            for e in entries:
                e["rank"] = 1 + len(ahead.get(e["id"], ())) if e["id"] in ahead else None
        if len(scored) > 1:
            for e in scored:
                if all(e["id"] in ahead[o["id"]] for o in scored if o is not e):
                    e["metrics"][name]["best"] = True
    ranks = [e.get("rank") for e in entries]
    for e in entries:
        e["tied"] = e.get("rank") is not None and ranks.count(e["rank"]) > 1


def _with_means(entry: dict[str, Any], draws: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`draws`, where a metric has none (an entry of collapsed seeds, whose matrices stop
    early) its recorded mean as a point: compared without an interval of its own."""
    filled = dict(draws)
    for name, values in draws.items():
        mean = entry["metrics"].get(name, {}).get("mean")
        if np.isnan(values).all() and mean is not None:
            filled[name] = np.full_like(values, mean)
    return filled


def _ahead(a: np.ndarray, b: np.ndarray, higher: bool, tail: float) -> bool:
    """Whether `a` is better than `b` beyond noise: the interval of their difference, in the
    better direction, lies above 0."""
    difference = (a - b) if higher else (b - a)
    difference = difference[~np.isnan(difference)]
    return bool(difference.size) and float(np.quantile(difference, tail)) > 0
