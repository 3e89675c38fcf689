"""Aggregation over seeds, and intervals over items (bootstrap, Wilson)."""

from __future__ import annotations

import math

import pytest

from clbench.eval.records import ItemRecord
from clbench.metrics.aggregate import aggregate_over_seeds, summarise


def test_mean_and_sample_std_over_seeds() -> None:
    s = summarise([0.5, 0.7, 0.9])
    assert s.mean == pytest.approx(0.7)
    assert s.std == pytest.approx(0.2)  # sqrt(((.2)^2 + 0 + (.2)^2) / 2), ddof=1
    assert s.n == 3
    assert s.format(2) == "0.70 ± 0.20 (n=3)"


def test_single_seed_says_n_equals_one_and_has_no_spread() -> None:
    s = summarise([0.42])
    assert s.std is None and s.n == 1
    assert s.format(2) == "0.42 (n=1)"


def test_a_value_that_rounds_to_zero_has_no_sign() -> None:
    from clbench.metrics.aggregate import format_value

    assert format_value(-0.0) == "0.000" and format_value(-0.0004) == "0.000"
    assert format_value(-0.0006) == "-0.001" and format_value(0.25, 2) == "0.25"
    assert summarise([-0.0001, 0.0001]).format() == "0.000 ± 0.000 (n=2)"


def test_undefined_values_are_counted_as_missing() -> None:
    s = summarise([0.2, None, float("nan"), 0.4])
    assert (s.mean, s.n, s.missing) == (pytest.approx(0.3), 2, 2)
    empty = summarise([None])
    assert empty.mean is None and empty.format() == "n/a (n=0)"


def test_aggregate_groups_by_method_and_metric() -> None:
    runs = [
        {"method": "sft", "seed": 0, "metrics": {"acc": {"value": 0.5}, "bwt": {"value": None}}},
        {"method": "sft", "seed": 1, "metrics": {"acc": {"value": 0.7}, "bwt": {"value": -0.1}}},
        {"method": "grpo", "seed": 0, "metrics": {"acc": {"value": 0.3}}},
    ]
    agg = aggregate_over_seeds(runs)
    assert agg["sft"]["acc"].mean == pytest.approx(0.6) and agg["sft"]["acc"].n == 2
    assert agg["sft"]["bwt"].n == 1 and agg["sft"]["bwt"].missing == 1
    assert agg["grpo"]["acc"].format(1) == "0.3 (n=1)"
    with pytest.raises(ValueError, match="two runs with seed 0"):
        aggregate_over_seeds(runs + [runs[0]])


def test_wilson_interval_against_hand_computed_values_and_at_the_edges() -> None:
    from clbench.eval.column import summarise_cell
    from clbench.metrics.aggregate import wilson_interval

    z = 1.959964  # the normal's 97.5% point
    # 43 of 100 by hand: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    p, n = 0.43, 100
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    mid = wilson_interval(43, 100)
    assert (mid.low, mid.high) == pytest.approx((centre - half, centre + half), abs=1e-6)
    assert (mid.low, mid.high) == pytest.approx((0.3373, 0.5278), abs=1e-4)
    # at 0 and 1 a percentile bootstrap over items says [0, 0] and [1, 1]; Wilson keeps a width
    none, every = wilson_interval(0, 100), wilson_interval(100, 100)
    assert none.low == 0.0 and none.high == pytest.approx(z * z / (n + z * z), abs=1e-6)
    assert every.high == 1.0 and every.low == pytest.approx(1 - none.high, abs=1e-12)
    assert wilson_interval(0, 0) is None and mid.method == "Wilson score"

    records = [ItemRecord(id=str(i), completion="", reward=0.0, correct=False)
               for i in range(100)]
    cell = summarise_cell("math", records)
    assert cell.score == 0.0 and cell.interval["high"] == pytest.approx(none.high)
    assert summarise_cell("math", records, bootstrap_samples=0).interval is None
