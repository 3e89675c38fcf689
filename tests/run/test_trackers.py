"""`--report-to`: a run's steps, rows of R, metrics and config in an experiment tracker's files
under the run folder, read back with the tracker's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import run_cli

from clbench.results import read_results
from clbench.run import trackers
from clbench.spec.options import RunOptions

pytestmark = pytest.mark.usefixtures("single_thread")


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(folder))  # the run's own events (its config: a sub-folder)
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)]
            for tag in reader.Tags()["scalars"]}


def test_a_run_logs_its_steps_rows_and_metrics_to_tensorboard_in_its_folder(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--out", str(out),
                   "--device", "cpu", "--report-to", "tensorboard",
                   "--set", "stages[0].budget.steps=3", "--set", "stages[1].budget.steps=2"])
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    scalars = _scalars(out / "trackers" / "smoke-sft-s0")
    assert list((out / "trackers" / "smoke-sft-s0").rglob("hparams.yml"))  # the config too
    # every step at the run's global step: stage 2's steps follow stage 1's
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    logged = [v for _, v in scalars["train/loss"]]
    assert logged == pytest.approx([s["loss"] for stage in result.stages
                                    for s in _steps(out, stage.index)], rel=1e-6)
    # each row of R where its stage ended: row 0 at 0, row 1 after 3 steps, row 2 after 5
    for j, column in enumerate(result.columns):
        logged_rows = scalars[f"R/{column.name}"]
        assert [step for step, _ in logged_rows] == [0, 3, 5]
        assert [v for _, v in logged_rows] == pytest.approx([row[j].score
                                                             for row in result.matrix])
    ((step, acc),) = scalars["metrics/acc"]
    assert step == 5 and acc == pytest.approx(result.metrics["acc"].value)


def _steps(run_dir: Path, stage: int) -> list[dict]:
    import json

    prefix = f"stage {stage} step "
    return [json.loads(line.split(prefix, 1)[1]) for line in
            (run_dir / "run.log").read_text().splitlines() if prefix in line]


def test_a_tracker_that_is_not_installed_is_one_message_before_anything_runs(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "wandb", "clbench_no_such_package")
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--out", str(tmp_path / "r"),
                   "--device", "cpu", "--report-to", "wandb"])
    assert res.exit_code == 2
    assert "--report-to wandb needs the `clbench_no_such_package` package" in res.output
    assert "pip install 'clbench[wandb]'" in res.output
    assert not (tmp_path / "r").exists()


def test_wandb_logs_offline_into_the_run_folder_unless_the_user_configured_it(
        tmp_path: Path, monkeypatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no `wandb login`
    trackers.prepare_environment(["wandb", "mlflow"], tmp_path / "run")
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    assert os.environ["WANDB_DIR"] == str(tmp_path / "run" / "trackers")
    assert os.environ["MLFLOW_TRACKING_URI"] == \
        (tmp_path / "run" / "trackers" / "mlruns").resolve().as_uri()
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password key\n")
    (tmp_path / ".netrc").chmod(0o600)
    trackers.prepare_environment(["wandb"], tmp_path / "run")
    assert "WANDB_MODE" not in os.environ  # logged in: online, as the user set it up


def test_a_sweep_passes_the_trackers_on_to_each_run() -> None:
    args = RunOptions(suite="smoke", method="sft", report_to=["tensorboard", "mlflow"]
                      ).command_line()
    assert " ".join(args).endswith("--report-to tensorboard --report-to mlflow")
