"""The paper's four-domain stream on the CPU default, end to end: the starter-code suite's task
columns on the embedded model (a step per stage, a few items per column), code graded in the
sandbox."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from fakes import run_cli
from where import REPO

from clbench.results import read_results

pytestmark = [pytest.mark.slow, pytest.mark.embedded]


def test_the_four_domain_stream_runs_end_to_end_on_the_embedded_model(tmp_path: Path) -> None:
    """starter-code without its lm-eval probe (its task index alone takes longer than the rest
    of a row here): every task column as the suite declares it."""
    suite = yaml.safe_load((REPO / "suites" / "starter-code.yaml").read_text())
    suite["probes"] = [p for p in suite["probes"] if "lm_eval" not in p]
    suite_file = tmp_path / "starter-code.yaml"
    suite_file.write_text(yaml.safe_dump(suite))
    out = tmp_path / "run"
    sets = [f"stages[{i}].budget.steps=1" for i in range(4)]
    sets += [f"stages[{i}].budget.{field}" for i in range(4)
             for field in ("prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=32")]
    sets += ["protocol.eval_size=4", "protocol.bootstrap_samples=20",
             "protocol.decoding.max_new_tokens=40"]
    args = ["run", "--suite", str(suite_file), "--method", "grpo", "--seed", "0", "--out",
            str(out), "--no-base-cache"]
    for s in sets:
        args += ["--set", s]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    done = read_results(out / "results.json")
    assert done.status == "complete"
    assert [c.name for c in done.columns] == [
        "math", "science", "tool_use", "code", "math_ood", "science_ood", "tool_use_ood",
        "code_ood"]
    assert [s.name for s in done.stages] == ["math", "science", "tool_use", "code"]
    assert len(done.matrix) == 5 and all(cell is not None for row in done.matrix
                                         for cell in row)
    code = done.columns[3]
    assert (code.source, code.source_version) == ("code.generated", "1")
    # the code column was graded by running code: its rollouts had rewards, its cells scores
    assert done.stages[3].counters["rollouts"] > 0
    expected = "bubblewrap" if shutil.which("bwrap") else "rlimits"
    assert done.versions["code_sandbox"] == expected
