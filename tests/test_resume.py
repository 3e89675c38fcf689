"""Kill-and-resume: a run killed with SIGKILL in the middle of a stage, then resumed, ends with the
same accuracy matrix and the same per-item completions as an uninterrupted run (bit-identical on
CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clbench.results import read_results

HERE = Path(__file__).resolve().parent

# The child runs `clbench run` through the CLI with the test plugins of test_protocol.py.
CHILD = """
import sys
sys.path.insert(0, {here!r})
from test_protocol import run_cli
res = run_cli(sys.argv[1:])
sys.stdout.write(res.output)
sys.exit(res.exit_code)
"""


def _items(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): p.read_text()
            for p in sorted((run_dir / "items").rglob("*.jsonl"))}


def _signal_mid_stage_2(args: list[str], tmp_path: Path, sig: int) -> tuple[int, str]:
    """Run `clbench run` in a child paused inside stage 2, send it `sig`; (exit code, output)."""
    from test_protocol import PAUSE_ENV

    marker = tmp_path / "paused"
    env = dict(os.environ, **{PAUSE_ENV: "2:1", PAUSE_ENV + "_MARKER": str(marker)})
    # A shell that starts a job in the background has it ignore SIGINT, and children inherit
    # that (Python then installs no Ctrl-C handler): the child is given the default back.
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE)), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"the child ended early:\n{child.stdout.read().decode()}")
            assert time.monotonic() < deadline, "the child never reached stage 2"
            time.sleep(0.2)
        os.kill(child.pid, sig)
        output = child.communicate(timeout=120)[0].decode()
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, output


@pytest.mark.slow
def test_sigkill_mid_stage_then_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    from test_protocol import SUITE, run_cli, write_suite

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 3"))
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "5",
              "--device", "cpu"]
    straight = tmp_path / "straight"
    # evaluated, not copied from the cache, so row 0 is compared too
    assert run_cli(common + ["--out", str(straight), "--no-base-cache"]).exit_code == 0

    killed = tmp_path / "killed"
    code, _ = _signal_mid_stage_2(common + ["--out", str(killed)], tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    partial = read_results(killed / "results.json")
    assert partial.status == "partial" and len(partial.matrix) == 2  # base + stage 1

    res = run_cli(common + ["--out", str(killed), "--resume"])
    assert res.exit_code == 0, res.output
    assert "resuming after stage 1" in res.output
    a, b = read_results(straight / "results.json"), read_results(killed / "results.json")
    assert b.status == "complete"
    assert b.score_matrix() == a.score_matrix()
    assert _items(killed) == _items(straight)  # same completions, item by item
    assert [s.summary for s in b.stages] == [s.summary for s in a.stages]  # same losses
    assert {k: v.value for k, v in b.metrics.items()} == {k: v.value for k, v in a.metrics.items()}


def test_resume_of_a_complete_run_reprints_without_training(tmp_path: Path) -> None:
    from test_protocol import SUITE, run_cli, write_suite

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    args = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
            "--out", str(tmp_path / "r")]
    assert run_cli(args).exit_code == 0
    before = (tmp_path / "r" / "results.json").read_bytes()
    res = run_cli(args + ["--resume"])
    assert res.exit_code == 0 and "already complete" in " ".join(res.output.split())
    assert (tmp_path / "r" / "results.json").read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, word", [
    (signal.SIGINT, 130, "interrupted"),   # Ctrl-C
    (signal.SIGTERM, 143, "terminated"),   # what a scheduler sends before it kills a job
])
def test_a_stop_request_mid_stage_keeps_completed_stages(tmp_path: Path, sig: int, code: int,
                                                         word: str) -> None:
    from test_protocol import SUITE, run_cli, write_suite

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 3"))
    out = tmp_path / word
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "5",
              "--device", "cpu", "--out", str(out)]
    exit_code, output = _signal_mid_stage_2(common, tmp_path, sig)
    assert exit_code == code, output
    assert "Traceback" not in output
    assert f"{word}; row 0 and stage 1 are saved" in output and "--resume" in output
    partial = read_results(out / "results.json")
    assert partial.status == "partial" and len(partial.matrix) == 2  # base + stage 1 kept
    resumed = run_cli(common + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert read_results(out / "results.json").status == "complete"


def test_stop_message_names_what_is_saved(tmp_path: Path) -> None:
    from clbench.protocol import saved_rows

    assert saved_rows(0, tmp_path) == (f"no row was complete yet (row 0, the base model, was being "
                                       f"evaluated) in {tmp_path}")
    assert saved_rows(1, tmp_path) == f"row 0 (the base model) is saved in {tmp_path}"
    assert saved_rows(2, tmp_path) == f"row 0 and stage 1 are saved in {tmp_path}"
    assert saved_rows(4, tmp_path) == f"row 0 and stages 1..3 are saved in {tmp_path}"
