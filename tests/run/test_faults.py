"""Faults inside a run: a loss that turns NaN (stopped or skipped, by the protocol's setting), a
method plugin that raises, a disk that fills or a folder that refuses writes while saving. Each
ends in one message naming where, the run marked failed with its completed rows kept, and the
files written before intact."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner

from clbench.cli import cli
from clbench.plugins import registry
from clbench.results import read_results
from clbench.train.api import Method, MethodConfig, StageReport

pytestmark = pytest.mark.e2e


def _run(out: Path, *extra: str, method: str = "sft") -> Any:
    return CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method, "--device",
                                    "cpu", "--out", str(out), "--no-base-cache", *extra])


@pytest.fixture
def nan_at_stage_2_step_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """SFT's loss is NaN in the first step of stage 2 (every other step as it is)."""
    from clbench_methods.sft import SFTHooks

    real = SFTHooks.loss

    def loss(self, loop, batch, part):
        value, stats = real(self, loop, batch, part)
        if loop.ctx.stage_index == 2 and loop.counters.values.get("optimizer_steps", 0) == 0 \
                and loop.counters.values.get("skipped_steps", 0) == 0:
            value = value * float("nan")
        return value, stats

    monkeypatch.setattr(SFTHooks, "loss", loss)


def test_a_nan_loss_stops_the_run_with_the_step_named_and_rows_kept(
        tmp_path: Path, nan_at_stage_2_step_1: None) -> None:
    result = _run(tmp_path / "run")
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "stage 2 (science) step 1 of" in message and "loss nan" in message
    assert "training diverged" in message and "protocol.nonfinite_loss" in message
    assert "Traceback" not in result.output
    stored = read_results(tmp_path / "run" / "results.json")
    assert stored.status == "failed" and "stage 2 (science) step 1" in stored.error
    assert len(stored.matrix) == 2  # row 0 and the row after stage 1 are kept


def test_a_nan_loss_is_skipped_when_the_protocol_says_so(tmp_path: Path,
                                                         nan_at_stage_2_step_1: None) -> None:
    import torch
    from safetensors.torch import load_file

    result = _run(tmp_path / "run", "--set", "protocol.nonfinite_loss=skip")
    assert result.exit_code == 0, result.output
    stored = read_results(tmp_path / "run" / "results.json")
    assert stored.status == "complete"
    second = stored.stages[1]
    assert second.counters["skipped_steps"] == 1
    assert second.summary["skipped_step"] == 1.0  # one record, and its loss left out
    assert all(math.isfinite(v) for s in stored.stages for v in s.summary.values())
    weights = sorted((tmp_path / "run" / "checkpoints").rglob("*.safetensors"))
    assert weights
    assert all(torch.isfinite(t).all() for t in load_file(str(weights[-1])).values())
    shown = CliRunner().invoke(cli, ["report", str(tmp_path / "run")])
    assert shown.exit_code == 0 and "nan" not in shown.output.lower()


class Exploding(Method):
    name: ClassVar[str] = "exploding"
    description: ClassVar[str] = "raises in its second stage"
    Config = MethodConfig

    def train_stage(self, ctx: Any) -> StageReport:
        if ctx.stage_index == 2:
            raise ValueError("the plugin's own bug")
        return StageReport(steps=[{"loss": 0.0}] * ctx.budget.steps)


def test_a_plugin_that_raises_fails_the_run_by_name_with_the_rows_kept(tmp_path: Path) -> None:
    with registry.extra_plugins(methods={"exploding": Exploding}):
        result = _run(tmp_path / "run", method="exploding")
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert ("stage 2 (science): the method 'exploding' (test_faults.Exploding) raised "
            "ValueError: the plugin's own bug") in message
    assert "run.log" in message and "Traceback" not in result.output
    stored = read_results(tmp_path / "run" / "results.json")
    assert stored.status == "failed" and len(stored.matrix) == 2
    assert "the method 'exploding'" in stored.error
    log = (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in log and "the plugin's own bug" in log


class Exiting(Exploding):
    name: ClassVar[str] = "exiting"
    description: ClassVar[str] = "ends the process in its second stage"

    def train_stage(self, ctx: Any) -> StageReport:
        if ctx.stage_index == 2:
            sys.exit(0)
        return super().train_stage(ctx)


class Swallowing(Exploding):
    name: ClassVar[str] = "swallowing"
    description: ClassVar[str] = "catches the stop request of its second stage and goes on"

    def train_stage(self, ctx: Any) -> StageReport:
        if ctx.stage_index == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this returns
            except KeyboardInterrupt:
                pass
        return StageReport(steps=[{"loss": 0.0}] * ctx.budget.steps)


@pytest.mark.parametrize("plugin, said", [
    (Exiting, "called sys.exit(0): a method returns its report, it does not end the process"),
    (Swallowing, "caught a stop request (Ctrl-C, SIGTERM) and went on: the stage is not kept"),
])
def test_a_plugin_that_exits_or_swallows_a_stop_fails_the_run(tmp_path: Path, plugin: type,
                                                              said: str) -> None:
    """Exit status 0 would say a partial run completed; a stop a method caught would train on
    past what the user asked."""
    with registry.extra_plugins(methods={plugin.name: plugin}):
        result = _run(tmp_path / "run", method=plugin.name)
    assert result.exit_code == 1, result.output
    assert f"stage 2 (science): the method '{plugin.name}' (test_faults.{plugin.__name__}) " \
        f"{said}" in " ".join(result.output.split())
    stored = read_results(tmp_path / "run" / "results.json")
    assert stored.status == "failed" and len(stored.matrix) == 2
    assert not (tmp_path / "run" / "checkpoints" / "stage2").exists()


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES])
def test_a_full_disk_while_saving_a_stage_is_one_message_and_keeps_what_was_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    import safetensors.torch

    out = tmp_path / "run"
    saves = {"n": 0}
    real = safetensors.torch.save_model

    def save_model(model, filename, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] == 2:  # the second stage's checkpoint: the disk is full now
            Path(filename).write_bytes(b"partial")
            raise OSError(error, os.strerror(error), filename)
        return real(model, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_model", save_model)
    result = _run(out, "--checkpoint-minutes", "1000")
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert os.strerror(error) in message and "Traceback" not in result.output
    stored = read_results(out / "results.json")  # the results written before: whole, readable
    assert stored.status in ("partial", "failed") and len(stored.matrix) == 2
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "stage1" in checkpoints and "stage2" not in checkpoints  # no half-written stage
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(safetensors.torch, "save_model", real)
    resumed = _run(out, "--resume")  # the disk has room again: the run continues from stage 1
    assert resumed.exit_code == 0, resumed.output
    assert read_results(out / "results.json").status == "complete"
    assert json.loads((out / "results.json").read_text())["matrix"][2] is not None


def test_an_out_folder_that_cannot_be_made_is_one_message(tmp_path: Path) -> None:
    result = _run(Path("/proc/clbench-cannot-be-here"))
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert ("cannot create or lock the run folder /proc/clbench-cannot-be-here (No such file or "
            "directory); choose another --out") in flat
    assert "Traceback" not in result.output


def test_a_file_size_limit_is_one_message_naming_the_file(tmp_path: Path) -> None:
    """`ulimit -f` (or a full disk) while safetensors writes weights: its own SafetensorError
    is said as the system's error, with the file, not as a traceback."""
    import resource
    import subprocess

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))  # below the weights

    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "clbench.cli", "run", "--suite", "smoke",
                           "--method", "sft", "--out", str(out), "--no-base-cache"],
                          preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"error: {out}/checkpoints/base-weights.safetensors: File too large" in done.stderr
