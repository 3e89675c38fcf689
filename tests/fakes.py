"""Plugins and suites the tests share, small but real.

- `FakeAddition` and `FakeMethod` (the `fake_plugins` fixture of conftest.py registers them in
  place of the installed plugins): a deterministic task source and a method that trains nothing.
- `EchoDigit` and `EchoSFT` (registered by `run_cli`, also in the subprocesses test_resume.py
  starts): a digit-echo task (reward when the completion starts with the task's digit) and a
  supervised method that trains on the references with data drawn from torch's RNG and a
  learning rate that decays with the method's own step counter across stages, so that a resume
  that lost the RNG seeding or the method state would change the numbers; `SUITE` runs them on a
  tiny model in seconds.

Import from tests as `from fakes import ...` (pytest puts `tests/` on the path).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from click.testing import CliRunner
from pydantic import Field

from clbench.plugins import registry
from clbench.tasks.base import Example, Grade, Split, TaskParams, TaskSource
from clbench.train.api import Method, MethodConfig, StageContext, StageReport
from clbench.train.rollout import encode_chat


class FakeAdditionParams(TaskParams):
    level: int = Field(default=1, ge=1, le=3, description="Digits per operand.")


class FakeAddition(TaskSource):
    """Adds two numbers; a deterministic stand-in for a real task source."""

    name = "fake.addition"
    description = "Add two numbers (test source)."
    domain = "math"
    origin = "offline"
    license = "Apache-2.0"
    Params = FakeAdditionParams

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        offset = 0 if split == "train" else 10_000
        base = 10 ** (self.params.level - 1)
        items = []
        for i in range(size):
            a, b = base + (seed + i) % 7, base + offset + i
            items.append(Example(id=f"{split}-{i}",
                                 messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                                 reference=f"{a} + {b} = {a + b}.\nAnswer: {a + b}",
                                 answer=a + b))
        return items

    def grade(self, example: Example, completion: str) -> Grade:
        ok = completion.strip().endswith(f"Answer: {example.answer}")
        return Grade(reward=float(ok), correct=ok, feedback=None if ok else "wrong answer")


class FakeMethodConfig(MethodConfig):
    lr: float = Field(default=1e-5, gt=0, description="Learning rate.")
    beta: float = Field(default=0.0, ge=0, description="KL weight.")


class FakeMethod(Method):
    """Does nothing to the model; a stand-in for a real method."""

    name = "fake-method"
    description = "A method that trains nothing (test plugin)."
    Config = FakeMethodConfig

    def train_stage(self, ctx: StageContext) -> StageReport:
        return StageReport(steps=[{"loss": 0.0}])



PAUSE_ENV = "CLBENCH_TEST_PAUSE_AT"  # "stage:step" where EchoSFT waits to be killed
PAUSE_GRADE_ENV = "CLBENCH_TEST_PAUSE_AT_GRADE"  # the n-th grading where EchoDigit waits
_grades = [0]  # gradings so far in this process


def _pause_here(marker_env: str) -> None:
    """test_resume.py kills the process while it waits here."""
    Path(os.environ[marker_env]).write_text("paused")
    time.sleep(300)


class DigitParams(TaskParams):
    digit: str = Field(default="3", description="The digit every item answers.")


class EchoDigit(TaskSource):
    """Answer with the task's digit, whatever the question's number."""

    name = "test.echo-digit"
    description = "answer with a fixed digit"
    domain = "test"
    Params = DigitParams

    def build(self, split: str, seed: int, size: int) -> list[Example]:
        digit = self.params.digit  # type: ignore[attr-defined]
        offset = seed * 100 + (0 if split == "train" else 5000)
        return [Example(id=f"{split}-{i}", messages=[
            {"role": "user", "content": f"#{offset + i}"}], reference=digit, answer=digit)
            for i in range(size)]

    def grade(self, example: Example, completion: str) -> Grade:
        _grades[0] += 1
        if os.environ.get(PAUSE_GRADE_ENV) == str(_grades[0]):
            _pause_here(PAUSE_ENV + "_MARKER")
        ok = completion.startswith(str(example.answer))
        return Grade(1.0 if ok else 0.0, ok, None if ok else f"expected {example.answer}")


class EchoSFTConfig(MethodConfig):
    lr: float = Field(default=3e-2, description="base learning rate")
    batch: int = Field(default=4, description="examples per step")


class EchoSFT(Method):
    """SFT on references; lr = lr / (1 + stages done before), a state kept across stages."""

    name = "test.echo-sft"
    description = "tiny supervised method for protocol tests"
    Config = EchoSFTConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.stages_done = 0

    def train_stage(self, ctx: StageContext) -> StageReport:
        cfg: EchoSFTConfig = self.config  # type: ignore[assignment]
        model, tok = ctx.model, ctx.tokenizer
        model.train()
        lr = cfg.lr / (1 + self.stages_done)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        report = StageReport()
        for step in range(ctx.budget.steps):
            if os.environ.get(PAUSE_ENV) == f"{ctx.stage_index}:{step}":
                _pause_here(PAUSE_ENV + "_MARKER")  # in the middle of a stage
            pick = torch.randint(len(ctx.train_examples), (cfg.batch,)).tolist()
            loss_sum = torch.zeros(())
            for i in pick:
                ex = ctx.train_examples[i]
                prompt = encode_chat(tok, ex.messages)
                target = tok(ex.reference, add_special_tokens=False)["input_ids"] + \
                    [tok.eos_token_id]
                ids = torch.tensor([prompt + target])
                labels = ids.clone()
                labels[0, :len(prompt)] = -100
                loss_sum = loss_sum + model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            (loss_sum / cfg.batch).backward()
            opt.step()
            record = {"loss": float(loss_sum.detach()) / cfg.batch, "lr": lr}
            report.steps.append(record)
            ctx.log_step(record)
        self.stages_done += 1
        report.counters = {"trained_tokens": 10 * ctx.budget.steps}
        model.eval()
        return report

    def state_dict(self) -> dict[str, Any]:
        return {"stages_done": self.stages_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stages_done = state["stages_done"]


PLUGINS = {"methods": {"test.echo-sft": EchoSFT}, "tasks": {"test.echo-digit": EchoDigit}}

SUITE = """
name: echo
description: two echo stages and a probe, on a tiny model
model: {name: tiny-llama, dtype: float32}
stages:
  - name: low
    task: {source: test.echo-digit, params: {digit: "3"}, train_size: 20, seed: 1}
    budget: {steps: 8, prompts_per_step: 4}
  - name: high
    task: {source: test.echo-digit, params: {digit: "7"}, train_size: 20, seed: 2}
    budget: {steps: 8, prompts_per_step: 4}
probes:
  - name: all
    kind: ood
    task: {source: test.echo-digit, params: {digit: "3"}, seed: 3}
protocol:
  eval_size: 6
  bootstrap_samples: 50
  decoding: {max_new_tokens: 2, batch_size: 6}
"""


def write_suite(folder: Path, text: str = SUITE) -> Path:
    path = folder / "echo.yaml"
    path.write_text(text)
    return path


PAUSE_SAVE_ENV = "CLBENCH_TEST_PAUSE_IN_SAVE"  # the n-th weights file written, then a wait


def _pause_in_nth_save() -> Any:
    """`safetensors.torch.save_model` that waits (to be killed) once it has written its n-th
    file, inside the checkpoint's temp folder, before the folder is renamed into place."""
    import contextlib

    import safetensors.torch

    if PAUSE_SAVE_ENV not in os.environ:
        return contextlib.nullcontext()
    real, calls = safetensors.torch.save_model, [0]

    def save_model(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == int(os.environ[PAUSE_SAVE_ENV]):
            _pause_here(PAUSE_ENV + "_MARKER")
        return out

    return mock.patch.object(safetensors.torch, "save_model", save_model)


def run_cli(args: list[str]) -> Any:
    from clbench.cli import cli

    with registry.extra_plugins(**PLUGINS), _pause_in_nth_save():
        return CliRunner().invoke(cli, args, catch_exceptions=False)


def run_spec(suite: Any, method: str, *, overrides: Any = (), **options: Any) -> Any:
    """:func:`clbench.plugins.runspec.build_run_spec` of the options a `clbench run` command
    line gives (`overrides` its `--set`s; paths as strings)."""
    from clbench.plugins.runspec import build_run_spec
    from clbench.spec.options import RunOptions

    fields = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
    return build_run_spec(RunOptions(suite=str(suite), method=method, sets=list(overrides),
                                     **fields))


def result_of(run: Any, method_config: dict[str, Any] | None = None) -> Any:
    """An empty result of `run`, as if its method's config in force were `method_config`."""
    from clbench.plugins.registry import PluginError, run_defaults
    from clbench.results import new_result

    if method_config is not None:
        run = run.model_copy(update={"method": run.method.model_copy(
            update={"params": method_config})})
    try:
        defaults = run_defaults(run)  # as a run records them
    except PluginError:  # a fake method no longer registered: none recorded
        defaults = []
    return new_result(run, defaults=defaults)


def smoke_run(tmp_path: Path, *overrides: str) -> Any:
    """The run spec of `sft` seed 0 on the smoke suite into `tmp_path/run`."""
    return run_spec("smoke", "sft", seed=0, out_dir=tmp_path / "run", overrides=overrides)


def old_suite_hash(suite: dict) -> str:
    """What content_hash gave for this suite dump when the schema had no more fields than it
    holds."""
    import hashlib
    import json

    canonical = json.dumps(suite, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
