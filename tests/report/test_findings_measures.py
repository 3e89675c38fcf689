"""The measures behind docs/findings.md (`benchmarks/findings.py`) against hand-computed values:
which columns count as transfer, the curvature of claim 5's fit, forgetting since a stage, and
the per-run table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from fakes import result_of, run_spec
from where import REPO

from clbench.results import Cell, StageRecord
from clbench.run.scores import metric_values

_SCRIPT = REPO / "benchmarks" / "findings.py"
_spec = importlib.util.spec_from_file_location("findings", _SCRIPT)
findings = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(findings)

# Rows of the smoke suite's matrix (columns math, science, math_ood): the base, then after each
# of its two stages.
ROWS = [[0.10, 0.20, 0.30],
        [0.60, 0.25, 0.50],
        [0.55, 0.70, 0.42]]
# MMD of each column's probes to the stage's training prompts.
DISTANCE = {1: {"math": 0.0, "science": 0.2, "math_ood": 0.4},
            2: {"math": 0.6, "science": 0.0, "math_ood": 0.8}}


def _run(tmp_path: Path):
    run = run_spec("smoke", "sft", seed=3, out_dir=tmp_path / "unused")
    result = result_of(run, {})
    result.matrix = [[Cell(score=s, n=10) for s in row] for row in ROWS]
    result.row_labels = ["base", "after math", "after science"]
    result.stages = [
        StageRecord(index=i, name=name, counters={"trained_tokens": tokens},
                    diagnostics={"distance": {"columns": {
                        c: {"mmd": d} for c, d in DISTANCE[i].items()}}})
        for i, name, tokens in [(1, "math", 1234), (2, "science", 56)]]
    result.metrics = metric_values(result, run.suite.protocol)
    result.compute.wall_time_s = 3725.0
    result.compute.peak_memory_bytes = 3 * 2**30
    result.status = "complete"
    return result


def test_transfer_points_are_the_columns_not_trained_yet_with_their_change(tmp_path) -> None:
    run = _run(tmp_path)
    mmd, change = findings.transfer_points(run, np.array(ROWS))
    # Stage 1 trains math: science (a later task) and the probe are transfer; stage 2 has
    # trained both tasks by its end, so only the probe is.
    assert mmd.tolist() == [0.2, 0.4, 0.8]
    assert change == pytest.approx([0.05, 0.20, -0.08])


def test_curvature_is_the_quadratic_term_through_the_transfer_points(tmp_path) -> None:
    run = _run(tmp_path)
    # Three points fix the quadratic: through (0.2, 0.05), (0.4, 0.20), (0.8, -0.08) by the
    # divided differences (0.75 and -0.7 per unit, then (-0.7 - 0.75) / 0.6).
    assert findings.curvature(run, np.array(ROWS)) == pytest.approx(-1.45 / 0.6)


def test_curvature_needs_three_distinct_distances(tmp_path) -> None:
    run = _run(tmp_path)
    run.stages[1].diagnostics["distance"]["columns"]["math_ood"]["mmd"] = 0.4
    assert findings.curvature(run, np.array(ROWS)) is None


def test_lost_since_a_stage_is_that_row_minus_the_last(tmp_path) -> None:
    run = _run(tmp_path)
    assert findings.lost("math", 1)(run, np.array(ROWS)) == pytest.approx(0.05)
    assert findings.lost("missing", 1)(run, np.array(ROWS)) is None


def test_the_runs_table_has_a_row_of_scores_cost_and_provenance(tmp_path, capsys) -> None:
    run = _run(tmp_path)
    run.git_revision = "abcdef0123"
    run.model.resolved["cpu_threads"] = 2
    findings.runs_table({"sft": [run]})
    row = capsys.readouterr().out.strip().splitlines()[-1]
    acc = np.mean(ROWS[-1][:2])
    assert row == (f"| sft | 3 | {acc:.3f} | -0.050 | {0.42 - 0.30:+.3f} | "
                   "0.10 → 0.60 → 0.55 | 1,234 / 56 | 1:02:05 | 3.0 GiB | 2 | abcdef0 |")


def test_an_interval_that_excludes_zero_is_beyond_noise() -> None:
    assert findings._interval(0.2, np.array([0.1, 0.2, 0.3] * 100), False) \
        .endswith("beyond noise")
    shown = findings._interval(0.0, np.array([-0.1, 0.0, 0.1] * 100), True)
    assert "within noise" in shown and shown.endswith("(items only: one seed)")


def test_a_measure_without_items_gets_an_exact_permutation_test_over_seeds() -> None:
    # Three seeds each, fully separated: 2 of the C(6, 3) = 20 splits are as extreme.
    shown = findings._permutation([3.0, 4.0, 5.0], [0.0, 1.0, 2.0])
    assert shown == "+3 (permutation p = 0.1, smallest possible 0.1) within noise"
    # Overlapping seeds: a split whose side sums to s differs by (2s - 15) / 3, odd over 3, so
    # every split is at least as far as the observed 1/3.
    assert findings._permutation([0.0, 3.0, 5.0], [1.0, 2.0, 4.0]) == \
        "+0.333 (permutation p = 1, smallest possible 0.1) within noise"
    # Four seeds each: 2 / C(8, 4) = 2 / 70 < 0.05, so full separation is beyond noise.
    assert findings._permutation([4.0, 5, 6, 7], [0.0, 1, 2, 3]).endswith(
        "(permutation p = 0.029, smallest possible 0.029) beyond noise")
    assert findings._permutation([1.0], [0.0, 2.0]) == "+0 (one seed: no test)"
