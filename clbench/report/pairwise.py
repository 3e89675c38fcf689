"""Do two methods differ beyond noise? Pairwise differences of their mean metrics over seeds,
with a seed-and-item bootstrap interval (`clbench report --compare`).

For each method setting of a suite (:func:`clbench.report.comparison.comparison_groups`) and
each bootstrap draw: its seeds are resampled with replacement, and every cell of each drawn
run's accuracy matrix is redrawn as the fraction correct of `n` items resampled with
replacement from the cell's own (a binomial draw at the cell's score and `n`: what resampling
the graded items gives); the metrics are computed from the redrawn matrix with the suite's
protocol, exactly as a run computes them, and averaged over the drawn seeds. The difference
of two methods' averages over the draws gives the percentile interval. Seeds carry most of the
spread when there are several; with one seed per method only the items vary, and the table
says so.

Cells are redrawn independently. A column's cells in different rows are scores of the same
items, so a difference between rows (BWT, forgetting) varies less than independent draws make
it vary: those intervals are wider than a joint resampling of the items would give
(conservative, never narrower).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from clbench.metrics.continual import MatrixError, compute_metrics, normalise_columns
from clbench.results import RunResult

#: The metrics compared by default: what the continual-learning literature reports first.
COMPARED = ("acc", "bwt", "forgetting", "ood_delta")


def bootstrap_draws(runs: Sequence[RunResult], metrics: Sequence[str], samples: int,
           rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`{metric: [samples]}`: one method's mean over its resampled seeds, per bootstrap draw
    (NaN where the metric is undefined for every drawn seed)."""
    scores = [np.array([[np.nan if v is None else v for v in row] for row in r.score_matrix()],
                       dtype=float) for r in runs]
    counts = [np.array([[0 if c is None else c.n for c in row] for row in r.matrix])
              for r in runs]
    columns = normalise_columns([c.model_dump() for c in runs[0].columns])
    try:
        protocol = runs[0].suite_spec().protocol
    except ValueError:  # a suite this schema no longer reads: the metrics' default variants
        protocol = None
    out = {m: np.full(samples, np.nan) for m in metrics}
    for b in range(samples):
        values: dict[str, list[float]] = {m: [] for m in metrics}
        for i in rng.integers(0, len(runs), size=len(runs)):
            n, p = counts[i], scores[i]
            defined = ~np.isnan(p) & (n > 0)
            redrawn = np.where(defined, rng.binomial(np.maximum(n, 1), np.nan_to_num(p))
                               / np.maximum(n, 1), np.nan)
            try:
                computed = compute_metrics(redrawn, columns, protocol, metrics=list(metrics))
            except MatrixError:  # a collapsed seed stops early: no metrics to redraw
                continue
            for m in metrics:
                value = computed.get(m, {}).get("value")
                if value is not None:
                    values[m].append(float(value))
        for m in metrics:
            if values[m]:
                out[m][b] = float(np.mean(values[m]))
    return out


def pairwise_differences(groups: dict[str, dict[str, list[RunResult]]],
                         metrics: Sequence[str] = COMPARED, samples: int = 2000,
                         confidence: float = 0.95, seed: int = 0) -> dict[str, list[dict]]:
    """Per suite, one entry per pair of method settings and metric: the difference of their
    means over seeds (first minus second, in label order), its bootstrap interval, the seeds
    behind each side and whether the interval leaves out 0."""
    tail = (1 - confidence) / 2
    out: dict[str, list[dict]] = {}
    for suite, labels in groups.items():
        rng = np.random.default_rng(seed)
        names = sorted(labels)
        draws = {label: bootstrap_draws(labels[label], metrics, samples, rng) for label in names}
        means = {label: {m: _mean_metric(labels[label], m) for m in metrics} for label in names}
        rows = []
        for a, b in itertools.combinations(names, 2):
            for m in metrics:
                if means[a][m] is None or means[b][m] is None:
                    continue
                diff = draws[a][m] - draws[b][m]
                diff = diff[~np.isnan(diff)]
                low, high = (np.quantile(diff, [tail, 1 - tail]) if diff.size
                             else (np.nan, np.nan))
                rows.append({
                    "a": a, "b": b, "metric": m,
                    "difference": means[a][m] - means[b][m],
                    "low": float(low), "high": float(high), "confidence": confidence,
                    "seeds": [len(labels[a]), len(labels[b])],
                    "beyond_noise": bool(low > 0 or high < 0),
                    "items_only": len(labels[a]) < 2 or len(labels[b]) < 2})
        out[suite] = rows
    return out


def _mean_metric(runs: Sequence[RunResult], metric: str) -> float | None:
    values = [r.metrics[metric].value for r in runs
              if metric in r.metrics and r.metrics[metric].value is not None]
    return float(np.mean(values)) if values else None


def difference_tables(data: dict[str, list[dict]], titles: dict[str, str]
                      ) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each suite's pairwise differences."""
    tables = []
    for suite, rows in data.items():
        if not rows:
            continue
        lines = []
        for r in rows:
            verdict = "beyond noise" if r["beyond_noise"] else "within noise"
            if r["items_only"]:
                verdict += " (items only: one seed)"
            lines.append([f"{r['a']} − {r['b']}", r["metric"], f"{r['difference']:+.3f}",
                          f"[{r['low']:+.3f}, {r['high']:+.3f}]",
                          f"{r['seeds'][0]} / {r['seeds'][1]}", verdict])
        confidence = round(100 * rows[0]["confidence"])
        tables.append((f"{titles.get(suite, suite)}: pairwise differences, {confidence}% "
                       "seed-and-item bootstrap", ["pair", "metric", "difference", "interval",
                                                   "seeds", "verdict"], lines))
    return tables
