"""`clbench sweep --launcher submitit`: each run a job on submitit's `local` cluster (processes of
this machine, as a Slurm job would be), a preempted job resuming its run, and `--status`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from clbench.cli import cli
from clbench.results import read_results
from clbench.spec.options import RunOptions
from clbench.sweep import cluster
from clbench.sweep.grid import grid_run

pytestmark = pytest.mark.e2e


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})


def test_a_sweep_on_the_local_cluster_runs_each_run_as_a_job_then_compares(
        tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    res = _cli("sweep", "--suite", "smoke", "--methods", "sft", "--seeds", "0,1", "--launcher",
               "submitit", "--cluster", "local", "--out", str(out), "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "submitted 2 job(s) to local" in res.output
    assert "sft seed 0: done" in res.output and "sft seed 1: done" in res.output
    assert "mean ± std over seeds" in res.output  # the comparison, once both finished
    for seed in (0, 1):
        assert read_results(out / "sft" / f"s{seed}" / "results.json").status == "complete"
    jobs = json.loads((out / "sweep-jobs.json").read_text())["jobs"]
    assert [(j["run"], j["seed"]) for j in jobs] == [("sft", 0), ("sft", 1)]
    status = _cli("sweep", "--status", "--out", str(out))
    assert status.exit_code == 0, status.output
    assert "0 queued, 0 running, 2 done, 0 failed" in status.output
    # again: both complete, nothing submitted
    again = _cli("sweep", "--suite", "smoke", "--methods", "sft", "--seeds", "0,1", "--launcher",
                 "submitit", "--cluster", "local", "--out", str(out), "--device", "cpu")
    assert again.exit_code == 0 and "submitted" not in again.output
    assert again.output.count(": complete") == 2


@pytest.mark.slow
def test_a_job_out_of_time_stops_its_run_cleanly_and_the_requeued_job_resumes_it(
        tmp_path: Path) -> None:
    """A one-minute job limit: submitit signals the job 30 s before it (as Slurm does before a
    time limit or a preemption); the job stops its run, which saves (a checkpoint every step),
    is requeued, and the run continues from its checkpoint to complete."""
    out = tmp_path / "sweep"
    options, run = grid_run(RunOptions(suite="smoke", method="sft", seed=0, device="cpu",
                                       checkpoint_minutes=0.0,
                                       sets=["stages[0].budget.steps=1500"]), out)
    from rich.console import Console

    quiet = Console(quiet=True)
    records = cluster.submit([(options, run)], out,
                             cluster.ClusterSettings(cluster="local", time_minutes=1), quiet)
    assert cluster.wait(records, out, quiet) == []
    result = read_results(Path(run.out_dir) / "results.json")
    assert result.status == "complete"
    text = (Path(run.out_dir) / "run.log").read_text()
    assert "terminated during stage 1" in text, text[-3000:]  # stopped cleanly, saving
    assert "stage 1 continues after step" in text  # from its checkpoint, not from the start
    assert text.count('stage 1 step {"step": 1500,') == 1
    assert text.count('stage 1 step {"step": 1,') == 1  # no step trained twice
    job_log = (out / "submitit" / f"{records[0]['job_id']}_0_log.out").read_text()
    assert "Requeued job" in job_log


def test_slurm_parameters_and_a_machine_without_slurm(tmp_path: Path) -> None:
    settings = cluster.ClusterSettings(cluster="slurm", partition="gpu", gpus_per_node=2,
                                       cpus_per_task=8, time_minutes=120, mem_gb=64,
                                       array_parallelism=4, account="lab")
    assert settings.parameters() == {
        "timeout_min": 120, "name": "clbench-sweep", "slurm_array_parallelism": 4,
        "gpus_per_node": 2, "slurm_signal_delay_s": 90, "slurm_partition": "gpu",
        "slurm_account": "lab", "cpus_per_task": 8, "mem_gb": 64}
    res = _cli("sweep", "--suite", "smoke", "--methods", "sft", "--launcher", "submitit",
               "--out", str(tmp_path / "s"), "--device", "cpu")
    assert res.exit_code == 2
    assert "--cluster slurm: Could not detect" in " ".join(res.output.split())


@pytest.mark.parametrize(("args", "message"), [
    (["--status"], "--status needs --out"),
    (["--status", "--out", "."], "no sweep-jobs.json"),
    (["--methods", "sft"], "--suite and --methods are required"),
    (["--suite", "smoke", "--methods", "sft", "--launcher", "submitit", "--jobs", "2"],
     "--jobs is for --launcher local"),
])
def test_sweep_options_that_do_not_go_together_are_one_message(args: list[str],
                                                               message: str) -> None:
    res = _cli("sweep", *args)
    assert res.exit_code == 2
    assert message in " ".join(res.output.split())
