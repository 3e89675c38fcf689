"""Diagnostics in a run: every stage records drift (against the base and the previous stage),
response drift, artifacts, prompt distances and collapse; a run whose method destroys the model
stops as `collapsed` when the suite says so; diagnostics settings do not change a suite's
identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import SUITE, run_cli, write_suite

from clbench import migrations
from clbench.cli import cli
from clbench.eval.records import read_records, records_path
from clbench.metrics.drift import DriftSettings, model_drift
from clbench.results import read_results
from clbench.spec.schema import SuiteSpec

pytestmark = pytest.mark.e2e

SHORT = SUITE.replace("steps: 8", "steps: 2")


def _run(tmp_path: Path, *sets: str, suite_text: str = SHORT) -> tuple[Path, object]:
    suite = write_suite(tmp_path, suite_text)
    out = tmp_path / "run"
    args = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--out", str(out),
            "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    return out, run_cli(args)


def test_every_stage_records_drift_artifacts_and_collapse(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out, res = _run(tmp_path, suite_text=SUITE)  # 8 steps a stage: each stage learns its digit
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.score_matrix()[2][1] == 1.0
    first, second = (s.diagnostics for s in result.stages)
    # stage 1's previous weights are the base's
    assert first["weight_drift"]["vs_previous"] == first["weight_drift"]["vs_base"]
    assert first["weight_drift"]["vs_base"]["all"]["nss"] > 0
    assert second["weight_drift"]["vs_previous"]["all"]["matrices"] == \
        second["weight_drift"]["vs_base"]["all"]["matrices"]  # tied weights found under alias
    # the recorded drift is the drift between the files the run kept
    base = load_file(str(out / "checkpoints" / "base-weights.safetensors"))
    final = load_file(str(out / "checkpoints" / "stage2" / "student.safetensors"))
    final = {name: final.get(name, final.get("lm_head.weight")) for name in base}
    by_hand = model_drift(base, final, DriftSettings(k=16))
    assert second["weight_drift"]["vs_base"]["all"]["nss"] == pytest.approx(by_hand["all"]["nss"])
    assert set(second["artifacts"]) == {"low", "high", "all"}
    # evaluation records say which responses hit the token cap
    records = read_records(records_path(out, 2, "low"))
    assert all(r.tokens is not None and r.finished is not None for r in records)
    assert second["artifacts"]["low"]["never_ended_share"] == \
        sum(not r.finished for r in records) / len(records)
    assert second["collapse"] == []
    # response drift: the trained model's answers moved from the base model's
    drift = second["response_drift"]
    assert drift["kl"] > 0 and first["response_drift"]["kl"] > 0
    assert 0 <= drift["edit_similarity"] < 1
    assert set(drift["columns"]) == {"low", "high", "all"}
    # distance of each stage's training prompts to each column's, beside the column's change
    distance = second["distance"]["columns"]
    assert set(distance) == {"low", "high", "all"}
    matrix = result.score_matrix()
    assert distance["high"]["change"] == pytest.approx(matrix[2][1] - matrix[1][1])
    assert distance["high"]["mmd"] < distance["low"]["mmd"]  # stage 2 trains on high's items
    assert {"response_drift", "distance"} <= set(result.stages[1].wall_time)
    # the report shows them, and its JSON carries them
    shown = CliRunner(env={"COLUMNS": "240"}).invoke(cli, ["report", str(out)])
    assert "diagnostics after each stage" in shown.output
    assert "responses after each stage" in shown.output
    assert "transfer against distance" in shown.output
    data = json.loads(CliRunner().invoke(cli, ["report", str(out), "--json"]).output)
    assert [d["stage"] for d in data["runs"][0]["diagnostics"]] == [1, 2]


def test_a_method_that_destroys_the_model_stops_the_run_as_collapsed(tmp_path: Path) -> None:
    out, res = _run(tmp_path, "method.lr=50", "protocol.diagnostics.collapse.stop=true",
                    "protocol.diagnostics.collapse.score_floor=0.5")
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.status == "collapsed"
    assert len(result.matrix) == 2 and len(result.stages) == 1  # row 0 and the collapsed row
    assert result.error.startswith("collapsed after stage 1 (low): every stream column scored "
                                   "below 0.5")
    assert result.stages[0].diagnostics["collapse"]


def test_without_stop_a_collapsed_row_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    out, res = _run(tmp_path, "method.lr=50", "protocol.diagnostics.collapse.score_floor=0.5")
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.status == "complete" and len(result.stages) == 2
    assert result.stages[0].diagnostics["collapse"]


def test_diagnostics_settings_leave_the_suite_identity_alone(tmp_path: Path) -> None:
    import yaml

    data = yaml.safe_load(SHORT)
    plain = SuiteSpec.model_validate(data)
    data["protocol"]["diagnostics"] = {"weight_drift": {"k": 4}, "collapse": {"stop": True}}
    tuned = SuiteSpec.model_validate(data)
    assert tuned.protocol.diagnostics.weight_drift.k == 4
    assert tuned.content_hash() == plain.content_hash()
    data["protocol"]["diagnostics"] = []  # how suites and results said "none" before
    assert SuiteSpec.model_validate(migrations.suite(data)).content_hash() == \
        plain.content_hash()
    data["protocol"]["diagnostics"] = ["weight_drift"]
    with pytest.raises(ValueError, match="diagnostics is a mapping"):
        SuiteSpec.model_validate(data)


def test_rollout_diagnostics_take_the_first_and_last_step() -> None:
    from clbench.run.diagnostics import rollout_diagnostics

    steps = [{"rollout_entropy": 1.5, "finished_rate": 0.25, "repetitive_rate": 0.0},
             {"loss": 0.1}, {"rollout_entropy": 0.5, "finished_rate": 1.0,
                             "repetitive_rate": 0.5}]
    assert rollout_diagnostics(steps) == {"entropy_first": 1.5, "entropy_last": 0.5,
                                          "never_ended_share_first": 0.75,
                                          "never_ended_share_last": 0.0,
                                          "repetitive_share_first": 0.0,
                                          "repetitive_share_last": 0.5}
    assert rollout_diagnostics([{"loss": 0.1}]) == {}  # SFT records neither
