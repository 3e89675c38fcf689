"""Shared fixtures: fake plugins registered through fake entry points, and suite files in tmp
dirs."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeAddition, FakeMethod
from toy import one_thread

from clbench.plugins import registry


@pytest.fixture
def single_thread() -> Iterator[None]:
    """torch on one thread for the test (tiny models gain nothing from more; see
    `toy.one_thread`). A module asks for it with
    `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    with one_thread():
        yield


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
