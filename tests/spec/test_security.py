"""No code runs from a suite or a results file, a model's own code runs only by an explicit flag
(recorded), and no name from a plugin or a file leads out of the run's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import result_of, run_spec

from clbench.cli import cli
from clbench.results import read_results, write_results
from clbench.spec.options import RunOptions
from clbench.spec.reading import SpecError
from clbench.spec.suites import default_out_dir, resolve_suite


def _smoke_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(resolve_suite("smoke").read_text() + extra)
    return path


def test_a_suite_or_an_override_cannot_let_a_model_run_its_own_code(tmp_path: Path) -> None:
    suite = _smoke_with(tmp_path, "")
    text = suite.read_text().replace("model:\n", "model:\n  trust_remote_code: true\n", 1)
    assert "trust_remote_code: true" in text
    suite.write_text(text)
    planned = CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method", "sft", "--plan"])
    assert planned.exit_code == 2
    assert "pass --trust-remote-code" in " ".join(planned.output.split())
    validated = CliRunner().invoke(cli, ["validate", str(suite)])  # refused alike
    assert validated.exit_code == 2
    assert "model (line" in validated.output and "cannot let a model run its own code" in \
        " ".join(validated.output.split())
    with pytest.raises(SpecError, match="a suite or an override cannot let a model run"):
        run_spec("smoke", "sft", overrides=["model.trust_remote_code=true"])


def test_the_flag_allows_it_is_recorded_and_reaches_a_sweeps_children(tmp_path: Path) -> None:
    plain = run_spec("smoke", "sft", out_dir=tmp_path / "a")
    allowed = run_spec("smoke", "sft", out_dir=tmp_path / "b", trust_remote_code=True)
    assert plain.model.trust_remote_code is False and allowed.model.trust_remote_code is True
    assert result_of(allowed, {}).model.spec["trust_remote_code"] is True  # in results.json
    # a sweep's child gets its run's options as a command line
    assert "--trust-remote-code" in RunOptions(suite="smoke", method="sft",
                                               trust_remote_code=True).command_line()
    assert "--trust-remote-code" not in RunOptions(suite="smoke", method="sft").command_line()
    planned = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--plan",
                                       "--trust-remote-code"])
    assert planned.exit_code == 0, planned.output


def test_a_suite_cannot_build_python_objects(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    suite = _smoke_with(tmp_path, f"x: !!python/object/apply:os.system ['touch {marker}']\n")
    result = CliRunner().invoke(cli, ["validate", str(suite)])
    assert result.exit_code == 2 and not marker.exists()


def test_names_cannot_lead_out_of_the_runs_folder() -> None:
    assert default_out_dir("starter", "pkg.mod:Class", 0) == "runs/starter/pkg.mod.Class/s0"
    for suite, method in [("starter", "../../etc"), ("..", "sft"), ("starter", "a/b"),
                          ("starter", "..")]:
        with pytest.raises(SpecError, match="cannot name a run folder"):
            default_out_dir(suite, method, 0)


def test_a_results_file_whose_column_names_a_path_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"id": "x", "completion": "the secret", "correct": true}\n')
    run = run_spec("smoke", "sft", out_dir=tmp_path / "unused")
    path = write_results(tmp_path / "runs" / "a" / "results.json", result_of(run, {}))
    data = json.loads(path.read_text())
    data["columns"][0]["name"] = "../../../secret"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"columns\[0\]\.name"):
        read_results(path)
    built = CliRunner().invoke(cli, ["leaderboard", "build", str(tmp_path / "runs"), "--out",
                                     str(tmp_path / "site")])
    assert "columns[0].name" in " ".join(built.output.split())
    site = tmp_path / "site"
    assert not site.exists() or "the secret" not in "".join(
        p.read_text(errors="replace") for p in site.rglob("*") if p.is_file())


def test_an_unknown_method_that_looks_like_a_path_creates_nothing(tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "../../escape"])
    assert result.exit_code == 2
    assert not (tmp_path.parent / "escape").exists() and not (tmp_path / "runs").exists()
