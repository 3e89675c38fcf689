"""Shared fixtures: fake plugins registered through fake entry points, and suite files in tmp
dirs."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import Field

from clbench.plugins import registry
from clbench.tasks.base import Example, Grade, Split, TaskParams, TaskSource
from clbench.train.api import Method, MethodConfig, StageContext, StageReport


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


@pytest.fixture(autouse=True)
def private_base_row_cache(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test (and the CLI subprocesses it starts) gets its own empty base-row cache, so no
    test reuses a row 0 computed by another or by the user's runs."""
    path = tmp_path_factory.mktemp("base-rows")
    monkeypatch.setenv("CLBENCH_BASE_ROWS", str(path))
    return path


@pytest.fixture
def fake_plugins() -> Iterator[None]:
    """Only the fake plugins are registered (the installed ones are hidden)."""
    entries = {
        registry.METHODS_GROUP: [registry.StaticEntryPoint("fake-method", registry.METHODS_GROUP,
                                                           FakeMethod, "fake-dist")],
        registry.TASKS_GROUP: [registry.StaticEntryPoint("fake.addition", registry.TASKS_GROUP,
                                                         FakeAddition, "fake-dist")],
    }
    with registry.using_entry_points(lambda group: entries.get(group, [])):
        yield


VALID_SUITE = """\
name: tiny
description: Two fake stages and one probe.
stages:
  - name: add1
    task: {source: fake.addition, params: {level: 1}, train_size: 8}
    budget: {steps: 2, prompts_per_step: 2}
  - name: add2
    task: {source: fake.addition, params: {level: 2}}
    budget: {steps: 3}
probes:
  - name: add3
    kind: ood
    task: {source: fake.addition, params: {level: 3}}
protocol:
  eval_size: 16
"""


@pytest.fixture
def write_suite(tmp_path: Path) -> Callable[..., Path]:
    """`write_suite(text, name="tiny.yaml")` writes a suite file and returns its path."""

    def write(text: str = VALID_SUITE, name: str = "tiny.yaml") -> Path:
        path = tmp_path / "suites" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write
