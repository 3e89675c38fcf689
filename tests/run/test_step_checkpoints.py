"""A stage stopped in its middle continues from its last step checkpoint: every built-in method
ends with the same matrix, completions, losses and counters as an uninterrupted run (CPU,
bit-identical), without training the steps before the checkpoint again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from toy import LowercaseTask
from where import TESTS

from clbench.cli import cli
from clbench.plugins import registry
from clbench.results import read_results
from clbench.train.api import StageContext, StageReport

STOP: dict[str, Any] = {"at": None}  # (stage, 1-based step): Ctrl-C once that step is logged


pytestmark = pytest.mark.e2e  # a suite run end to end


def stopping(base: type) -> type:
    """`base` with a Ctrl-C right after the step named in STOP (before its checkpoint)."""

    class Stopping(base):  # type: ignore[misc, valid-type]
        name = f"test.{base.name}-stopping"
        # trains as its parent does (only the step log is wrapped)
        supports_sharding = vars(base).get("supports_sharding", False)

        def train_stage(self, ctx: StageContext) -> StageReport:
            log_step = ctx.log_step

            def log_then_stop(record: dict[str, Any]) -> None:
                log_step(record)
                if STOP["at"] == (ctx.stage_index, record["step"]):
                    STOP["at"] = None
                    raise KeyboardInterrupt

            ctx.log_step = log_then_stop
            return super().train_stage(ctx)

    return Stopping


def stopping_runner(tmp_path: Path, method: str, suite: str, *args: str) -> Callable[..., Any]:
    """`run(out, *extra)`: `clbench run` of the stopping variant of `method` on `suite` (seed 3,
    a step checkpoint after every step), in process."""
    name = f"test.{method}-stopping"
    plugins = {"methods": {name: stopping(registry.load_method_class(method))},
               "tasks": {"toy.lowercase": LowercaseTask}}
    (tmp_path / "suite.yaml").write_text(suite)
    common = ["run", "--suite", str(tmp_path / "suite.yaml"), "--method", name, "--seed", "3",
              "--device", "cpu", "--no-base-cache", "--checkpoint-minutes", "0", *args]

    def run(out: Path, *extra: str) -> Any:
        with registry.extra_plugins(**plugins):
            return CliRunner().invoke(cli, [*common, "--out", str(out), *extra],
                                      catch_exceptions=False)

    return run


def stage_report_without_times(run_dir: Path, stage: int) -> dict[str, Any]:
    """`stages/stage{t}.json` (every step's record, counters, extras) less the time taken."""
    report = json.loads((run_dir / "stages" / f"stage{stage}.json").read_text())
    del report["wall_time"]
    for step in report["steps"]:
        del step["seconds"]
    return report


SUITE = """
name: lowercase
description: two stages of a toy task with a learning signal from the first step
model: {name: tiny-llama, dtype: float32}
stages:
  - name: first
    task: {source: toy.lowercase, train_size: 16, seed: 1}
    budget: {steps: 2, prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 8}
  - name: second
    task: {source: toy.lowercase, params: {k: 6}, train_size: 16, seed: 2}
    budget: {steps: 4, prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 8}
protocol:
  eval_size: 4
  bootstrap_samples: 20
  decoding: {max_new_tokens: 8, batch_size: 4}
"""


@pytest.mark.parametrize("method, sets", [
    ("sft", ["--set", "method.warmup_steps=2", "--set", "method.lr_schedule=cosine"]),
    # a KL reference from the start of the stage; a batch used for two steps
    ("grpo", ["--set", "method.beta=0.5", "--set", "method.inner_updates=2"]),
    ("sdpo", ["--set", "method.teacher=ema"]),
    # 16-bit weights: the EMA teacher keeps an fp32 shadow, saved and restored too
    ("sdpo", ["--set", "method.teacher=ema", "--set", "model.dtype=bfloat16",
              "--set", "model.mixed_precision=false"]),
    ("stable-sdpo", []),  # a teacher refreshed before steps 0 and 2 of the 4
    # add-ons: state across stages (the replay buffer, EWC's Fisher and anchor) restored from
    # stage 1's checkpoint, state within a stage (LwF's and merge's stage-start weights) from
    # the step checkpoint
    ("sft", ["--addon", "replay", "--addon", "ewc", "--set", "addon.replay.fraction=0.5"]),
    ("grpo", ["--addon", "lwf", "--addon", "merge", "--set", "addon.lwf.topk=5"]),
    ("sdpo", ["--addon", "replay", "--addon", "lwf", "--set", "method.feedback=rich"]),
])
def test_a_stage_stopped_in_its_middle_continues_from_its_last_step(
        tmp_path: Path, method: str, sets: list[str]) -> None:
    run = stopping_runner(tmp_path, method, SUITE, *sets)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run(straight).exit_code == 0
    STOP["at"] = (2, 3)
    res = run(stopped)
    assert res.exit_code == 130, res.output
    assert "row 0 and stage 1 are saved, and stage 2 up to step 2" in " ".join(res.output.split())
    assert sorted(p.name for p in (stopped / "checkpoints").glob("stage*")) == \
        ["stage1", "stage2-step2"]
    # the time of the kept steps is kept with them (rows 0 and 1 have counted theirs)
    kept = json.loads((stopped / "kept-time.json").read_text())
    assert kept["rows"] == 2 and kept["seconds"] > 0 and kept["peak_memory_bytes"] > 0
    partial = read_results(stopped / "results.json").compute.wall_time_s
    # the stopped sitting's peak is the run's, though no row recorded it (1 TiB: no sitting
    # here reaches it, so the resumed run must have taken it from the save point)
    kept["peak_memory_bytes"] = 2**40
    (stopped / "kept-time.json").write_text(json.dumps(kept))

    res = run(stopped, "--resume")
    assert res.exit_code == 0, res.output
    assert "stage 2 continues after step 2 of 4" in " ".join(res.output.split())
    log = (stopped / "run.log").read_text()
    # steps 1-2 were trained once, step 3 twice (stopped after it, before its checkpoint)
    assert [log.count(f'stage 2 step {{"step": {k},') for k in (1, 2, 3, 4)] == [1, 1, 2, 1]
    assert sorted(p.name for p in (stopped / "checkpoints").glob("stage*")) == ["stage2"]

    a, b = read_results(straight / "results.json"), read_results(stopped / "results.json")
    assert b.status == "complete"
    assert b.compute.wall_time_s >= partial + kept["seconds"]
    assert b.compute.peak_memory_bytes == 2**40
    def measured(stages: Any) -> list[dict[str, float]]:  # everything but the time taken
        return [{k: v for k, v in s.summary.items() if k != "seconds"} for s in stages]

    assert measured(b.stages) == measured(a.stages)  # same losses, rewards, gradient norms
    reports = [stage_report_without_times(run, 2) for run in (straight, stopped)]
    assert reports[0] == reports[1]
    assert [s.counters for s in b.stages] == [s.counters for s in a.stages]
    assert b.score_matrix() == a.score_matrix()
    items = {p.relative_to(straight): p.read_text()
             for p in sorted((straight / "items").rglob("*.jsonl"))}
    assert {p.relative_to(stopped): p.read_text()
            for p in sorted((stopped / "items").rglob("*.jsonl"))} == items
    # the comparison means something: the method did update the model in stage 2
    assert any(step["grad_norm"] > 0 for step in reports[0]["steps"])
    # and each add-on acted in it
    steps, extra = reports[0]["steps"], reports[0]["extra"]
    addons = [sets[i + 1] for i, arg in enumerate(sets) if arg == "--addon"]
    if "replay" in addons:
        assert [step["replayed_fraction"] for step in steps] == [0.5] * 4
    for addon, stat in (("ewc", "ewc_penalty"), ("lwf", "lwf_kl")):
        if addon in addons:
            assert any(step[stat] > 0 for step in steps), stat
    if "merge" in addons:
        assert extra["merge"] == {"alpha": 0.5}


def test_a_method_that_saves_progress_but_ignores_it_on_resume_fails_loudly(
        tmp_path: Path) -> None:
    sft = registry.load_method_class("sft")

    class Forgetful(stopping(sft)):  # type: ignore[misc, valid-type]
        name = "test.sft-forgetful"

        def train_stage(self, ctx: StageContext) -> StageReport:
            ctx.resume = None  # trains the stage from step 0 again, on mid-stage weights
            return super().train_stage(ctx)

    plugins = {"methods": {Forgetful.name: Forgetful}, "tasks": {"toy.lowercase": LowercaseTask}}
    (tmp_path / "suite.yaml").write_text(SUITE)
    args = ["run", "--suite", str(tmp_path / "suite.yaml"), "--method", Forgetful.name,
            "--device", "cpu", "--checkpoint-minutes", "0", "--out", str(tmp_path / "r")]
    with registry.extra_plugins(**plugins):
        STOP["at"] = (2, 3)
        assert CliRunner().invoke(cli, args).exit_code == 130
        res = CliRunner().invoke(cli, [*args, "--resume"])
    assert res.exit_code != 0
    assert "did not continue from it (ctx.resume)" in str(res.exception) + res.output
    assert read_results(tmp_path / "r" / "results.json").status == "failed"


# Each process of `accelerate launch` runs this: the CLI with the stopping method and the toy
# task registered; CLBENCH_TEST_STOP_AT="stage:step" raises Ctrl-C on every rank after that step
# (what a terminal's Ctrl-C does to the launcher's process group).
LAUNCHED = """
import os, sys
sys.path[:0] = [{here!r}, {tests!r}]
from toy import LowercaseTask
from test_step_checkpoints import STOP, stopping
from clbench.plugins import registry
from clbench.cli import cli

if os.environ.get("CLBENCH_TEST_STOP_AT"):
    STOP["at"] = tuple(int(x) for x in os.environ["CLBENCH_TEST_STOP_AT"].split(":"))
method = stopping(registry.load_method_class({method!r}))
with registry.extra_plugins(methods={{method.name: method}},
                            tasks={{"toy.lowercase": LowercaseTask}}):
    cli.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_stopped_in_a_stage_continue_from_the_step_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool) -> None:
    """Data parallel or sharded (FSDP2: the optimizer's shards gathered into the checkpoint
    and split again on resume), a stopped run ends as the straight one."""
    from test_distributed import _launch
    from test_sharded import FSDP2_CONFIG

    config = FSDP2_CONFIG if sharded else None
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(here=str(Path(__file__).resolve().parent),
                                      tests=str(TESTS), method="sdpo"))
    (tmp_path / "suite.yaml").write_text(SUITE)
    common = ["run", "--suite", str(tmp_path / "suite.yaml"), "--method", "test.sdpo-stopping",
              "--seed", "3", "--device", "cpu", "--no-base-cache", "--checkpoint-minutes", "0",
              "--set", "method.teacher=ema"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = _launch([*common, "--out", str(straight)], script=str(script), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    monkeypatch.setenv("CLBENCH_TEST_STOP_AT", "2:3")
    proc = _launch([*common, "--out", str(stopped)], script=str(script), config=config)
    assert proc.returncode != 0  # the launcher reports the ranks' exit status 130 as a failure
    # said once, by the main process: every rank stopped alike
    assert " ".join(proc.stderr.split()).count(
        "interrupted; row 0 and stage 1 are saved, and stage 2 up to step 2") == 1
    assert sorted(p.name for p in (stopped / "checkpoints").glob("stage*")) == \
        ["stage1", "stage2-step2"]
    monkeypatch.delenv("CLBENCH_TEST_STOP_AT")

    proc = _launch([*common, "--out", str(stopped), "--resume"], script=str(script),
                   config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stage 2 continues after step 2 of 4" in " ".join(proc.stdout.split())
    log = (stopped / "run.log").read_text()
    assert [log.count(f'stage 2 step {{"step": {k},') for k in (1, 2, 3, 4)] == [1, 1, 2, 1]

    a, b = read_results(straight / "results.json"), read_results(stopped / "results.json")
    assert b.status == "complete" and b.model.resolved["num_processes"] == 2
    assert b.model.resolved.get("sharding") == ("fsdp2" if sharded else None)
    reports = [stage_report_without_times(run, 2) for run in (straight, stopped)]
    assert reports[0] == reports[1]
    assert any(step["grad_norm"] > 0 for step in reports[0]["steps"])
    assert b.score_matrix() == a.score_matrix()
    items = {p.relative_to(straight): p.read_text()
             for p in sorted((straight / "items").rglob("*.jsonl"))}
    assert {p.relative_to(stopped): p.read_text()
            for p in sorted((stopped / "items").rglob("*.jsonl"))} == items


def test_a_run_stopped_in_its_first_stage_says_what_row_0_cost(tmp_path: Path) -> None:
    out = tmp_path / "r"
    STOP["at"] = (1, 1)
    res = stopping_runner(tmp_path, "sft", SUITE)(out)
    assert res.exit_code == 130, res.output
    partial = read_results(out / "results.json")
    assert len(partial.matrix) == 1 and partial.stages == []
    # row 0 took time and memory: the partial results say so (they used to say nothing)
    assert partial.compute.wall_time_s > 0 and partial.compute.device == "cpu"
    assert partial.compute.peak_memory_bytes


def test_a_joint_run_stopped_in_its_stage_continues_from_its_last_step(tmp_path: Path) -> None:
    """The joint reference's one stage (both stages' items mixed, 2 + 4 steps, each item under
    its own stage's token cap) stops and resumes like any stage, and ends as if never stopped."""
    first_cap = "max_new_tokens: 8}\n  - name: second"
    assert first_cap in SUITE
    run = stopping_runner(tmp_path, "grpo", SUITE.replace(first_cap, first_cap.replace("8", "3")),
                          "--joint")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run(straight).exit_code == 0
    STOP["at"] = (1, 5)
    res = run(stopped)
    assert res.exit_code == 130, res.output
    said = " ".join(res.output.split())
    assert "row 0 (the base model) is saved, and stage 1 up to step 4" in said
    assert [p.name for p in (stopped / "checkpoints").glob("stage*")] == ["stage1-step4"]

    res = run(stopped, "--resume")
    assert res.exit_code == 0, res.output
    assert "stage 1 continues after step 4 of 6" in " ".join(res.output.split())
    log = (stopped / "run.log").read_text()
    assert [log.count(f'stage 1 step {{"step": {k},') for k in range(1, 7)] == [1, 1, 1, 1, 2, 1]
    a, b = read_results(straight / "results.json"), read_results(stopped / "results.json")
    assert b.joint and b.status == "complete" and len(b.matrix) == 2
    reports = [stage_report_without_times(run, 1) for run in (straight, stopped)]
    assert reports[0] == reports[1] and len(reports[0]["steps"]) == 6
    assert b.score_matrix() == a.score_matrix()
    assert any(step["grad_norm"] > 0 for step in reports[0]["steps"])


@pytest.mark.parametrize("damaged", ["state.pt", "student.safetensors"])
def test_a_damaged_step_checkpoint_falls_back_to_the_last_intact_one(tmp_path: Path,
                                                                     damaged: str) -> None:
    """A step checkpoint cut short (a disk that failed, a copy interrupted) is named and left
    alone: the stage trains again from the previous stage's checkpoint, and the run ends as an
    uninterrupted one."""
    run = stopping_runner(tmp_path, "sft", SUITE)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run(straight).exit_code == 0
    STOP["at"] = (2, 3)
    assert run(stopped).exit_code == 130
    path = stopped / "checkpoints" / "stage2-step2" / damaged
    path.write_bytes(path.read_bytes()[:100])  # truncated
    res = run(stopped, "--resume")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert f"{path}:" in said and "stage 2 trains again from its start (its checkpoint after " \
        "step 2 is damaged)" in said
    a, b = read_results(straight / "results.json"), read_results(stopped / "results.json")
    assert b.status == "complete" and b.score_matrix() == a.score_matrix()
    assert [s.summary["loss"] for s in b.stages] == [s.summary["loss"] for s in a.stages]
