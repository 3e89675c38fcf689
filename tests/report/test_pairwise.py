"""`clbench report --compare`: pairwise differences of methods with seed-and-item bootstrap
intervals, against hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import result_of, run_spec

from clbench.cli import cli
from clbench.report.pairwise import pairwise_differences
from clbench.results import Cell, write_results
from clbench.run.scores import metric_values


def _run(tmp_path: Path, method: str, seed: int, final: float, n: int = 100):
    """A complete smoke run (2 stages, 1 probe) whose last row scores `final` everywhere,
    after a base row of 0.1 and a first stage at `final`."""
    run = run_spec("smoke", "sft", seed=seed, out_dir=tmp_path / "unused")
    result = result_of(run, {})
    result.method.name = method
    result.matrix = [[Cell(score=0.1, n=n) for _ in result.columns],
                     [Cell(score=final, n=n) for _ in result.columns],
                     [Cell(score=final, n=n) for _ in result.columns]]
    result.row_labels = ["base", "after math", "after science"]
    result.metrics = metric_values(result, run.suite.protocol)
    result.status = "complete"
    return result


def _groups(runs):
    return {"smoke": {r.method.name: [x for x in runs if x.method.name == r.method.name]
                      for r in runs}}


def _row(data, metric):
    return next(r for r in data["smoke"] if r["metric"] == metric)


def test_a_large_difference_is_beyond_noise_and_its_interval_covers_it(tmp_path: Path) -> None:
    runs = [_run(tmp_path, "good", s, 0.8) for s in range(3)] + \
        [_run(tmp_path, "poor", s, 0.3) for s in range(3)]
    acc = _row(pairwise_differences(_groups(runs), samples=400), "acc")
    assert (acc["a"], acc["b"], acc["seeds"]) == ("good", "poor", [3, 3])
    assert acc["difference"] == pytest.approx(0.5)
    assert acc["low"] < 0.5 < acc["high"] and acc["low"] > 0 and acc["beyond_noise"]


def test_the_same_method_twice_is_within_noise(tmp_path: Path) -> None:
    runs = [_run(tmp_path, "a", s, 0.5) for s in range(2)] + \
        [_run(tmp_path, "b", s, 0.5) for s in range(2)]
    for row in pairwise_differences(_groups(runs), samples=400)["smoke"]:
        assert row["difference"] == pytest.approx(0.0)
        assert row["low"] <= 0.0 <= row["high"] and not row["beyond_noise"]


def test_with_one_seed_the_interval_is_the_items_binomial_spread(tmp_path: Path) -> None:
    """ACC is the mean of the last row's two stream cells; each a fraction of n = 100 items.
    Var(ACC) = 2 p(1-p)/n / 4 per method; the difference of two independent methods has
    twice that; the 95% interval is about ±1.96 sd."""
    p, n = 0.5, 100
    runs = [_run(tmp_path, "a", 0, p, n), _run(tmp_path, "b", 0, p, n)]
    acc = _row(pairwise_differences(_groups(runs), samples=4000), "acc")
    sd = math.sqrt(2 * (2 * p * (1 - p) / n / 4))
    assert acc["items_only"] is True
    assert (acc["high"] - acc["low"]) / 2 == pytest.approx(1.96 * sd, rel=0.1)


def test_report_compare_prints_the_table_and_json(tmp_path: Path) -> None:
    files = []
    for method, final in (("good", 0.8), ("poor", 0.3)):
        for seed in range(2):
            files.append(write_results(tmp_path / f"{method}-s{seed}.json",
                                       _run(tmp_path, method, seed, final)))
    shown = CliRunner().invoke(cli, ["report", "--compare", *map(str, files)])
    assert shown.exit_code == 0, shown.output
    flat = " ".join(shown.output.split())
    assert "pairwise differences, 95% seed-and-item bootstrap" in flat
    assert "good − poor" in flat and "+0.500" in flat and "beyond noise" in flat
    data = json.loads(CliRunner().invoke(cli, ["report", "--compare", "--json",
                                               *map(str, files)]).output)
    (suite,) = data["pairwise"].values()
    assert {r["metric"] for r in suite} == {"acc", "bwt", "forgetting", "ood_delta"}
    markdown = CliRunner().invoke(cli, ["report", "--compare", "--markdown", *map(str, files)])
    assert "| good − poor | acc | +0.500 |" in markdown.output
