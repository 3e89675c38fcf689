"""A run's metrics from its accuracy matrix: what a run stores in results.json and what
`clbench report` and the leaderboard recompute to check a results file before showing it.

Light on purpose (numpy, the metric functions and the results schema): reading results never
imports the training stack.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clbench.metrics.continual import MatrixError, compute_metrics
from clbench.results import MetricValue, RunResult

#: Metrics where a lower value is better (every other one: higher).
LOWER_IS_BETTER = frozenset({"forgetting", "intransigence"})


def metric_values(result: RunResult, protocol: Any) -> dict[str, MetricValue]:
    """The protocol's metrics of `result`'s matrix (an undefined one with its note; per-stage
    values where a metric has them). Raises :class:`MatrixError` for a matrix without a row
    per stage."""
    matrix = [[np.nan if v is None else v for v in row] for row in result.score_matrix()]
    columns = [c.model_dump() for c in result.columns]
    computed = compute_metrics(np.array(matrix, dtype=float), columns, protocol)
    metrics: dict[str, MetricValue] = {}
    for name, entry in computed.items():
        per_stage = entry.get("per_stage")
        metrics[name] = MetricValue(
            value=entry["value"], variant=entry["variant"], note=entry.get("note"),
            higher_is_better=name not in LOWER_IS_BETTER,
            per_stage=None if per_stage is None else
            [None if v is None else float(v) for v in per_stage])
    return metrics


def recomputed_metrics(result: RunResult) -> tuple[dict[str, MetricValue], list[str]]:
    """`(metrics, mismatches)`: the metrics of a complete run's matrix under its suite's
    protocol, and one line per stored metric whose value differs from them (a file edited by
    hand, or written by a clbench whose metrics differ). The stored metrics, and no mismatch,
    where nothing can be recomputed (a run not complete, a joint reference run, a suite this
    clbench cannot read)."""
    if result.status != "complete" or result.joint:
        return result.metrics, []
    try:
        computed = metric_values(result, result.suite_spec().protocol)
    except (MatrixError, ValueError):
        return result.metrics, []
    mismatches = []
    for name, stored in result.metrics.items():
        now = computed.get(name)
        if now is None:
            continue  # a metric this clbench does not compute (e.g. added by a later one)
        if not _same(stored.value, now.value):
            mismatches.append(f"metric {name} is stored as {_shown(stored.value)} but the "
                              f"matrix gives {_shown(now.value)}")
    return {**result.metrics, **computed}, mismatches


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _shown(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.6g}"
