"""docs/plugins.md's complete method runs as written: its code blocks, in order, are a plugin
that trains a suite end to end, and each of them is in the example package it describes."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from where import REPO

from clbench.cli import cli
from clbench.plugins import registry

ROOT = REPO


def _complete_example() -> tuple[list[str], str]:
    """The Python blocks of the complete example's section, and its entry-point block."""
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = text[text.index("## A complete method, start to finish"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (toml,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    return blocks, toml


def test_every_block_of_the_complete_example_is_in_the_example_package() -> None:
    blocks, toml = _complete_example()
    assert len(blocks) == 4
    package = ROOT / "examples" / "plugins" / "clbench-rft"
    source = (package / "clbench_rft" / "__init__.py").read_text(encoding="utf-8")
    for block in blocks:
        assert block in source, block[:200]
    assert toml.strip() in (package / "pyproject.toml").read_text(encoding="utf-8")


@pytest.mark.e2e
def test_the_complete_example_runs_as_written(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, _ = _complete_example()
    module = types.ModuleType("docs_rft")
    monkeypatch.setitem(sys.modules, "docs_rft", module)
    exec(compile("".join(blocks), "docs/plugins.md", "exec"), module.__dict__)
    with registry.extra_plugins(methods={"docs-rft": module.RFT}):
        res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "docs-rft",
                                       "--addon", "replay", "--set", "method.threshold=0.5",
                                       "--out", str(tmp_path / "run"), "--no-base-cache"])
    assert res.exit_code == 0, res.output
    recorded = json.loads((tmp_path / "run" / "results.json").read_text())
    assert recorded["status"] == "complete"
    assert recorded["method"]["config"]["threshold"] == 0.5
    assert [a["name"] for a in recorded["addons"]] == ["replay"]
    steps = [s["summary"] for s in recorded["stages"]]
    assert all("kept_fraction" in s for s in steps)
