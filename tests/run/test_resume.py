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
from where import TESTS

from clbench.results import read_results

pytestmark = pytest.mark.e2e  # a suite run end to end


HERE = TESTS

# The child runs `clbench run` through the CLI with the test plugins of fakes.py.
CHILD = """
import sys
sys.path.insert(0, {here!r})
from fakes import run_cli
res = run_cli(sys.argv[1:])
sys.stdout.write(res.output)
sys.exit(res.exit_code)
"""


def _items(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): p.read_text()
            for p in sorted((run_dir / "items").rglob("*.jsonl"))}


def _signal_mid_stage_2(args: list[str], tmp_path: Path, sig: int,
                        pause: tuple[str, str] | None = None) -> tuple[int, str]:
    """Run `clbench run` in a child paused inside stage 2 (by default at its step 1; `pause` is
    another (variable, value) of the pauses of fakes.py), send it `sig`; (exit code, output)."""
    from fakes import PAUSE_ENV

    marker = tmp_path / "paused"
    variable, value = pause or (PAUSE_ENV, "2:1")
    env = dict(os.environ, **{variable: value, PAUSE_ENV + "_MARKER": str(marker)})
    # A shell that starts a job in the background has it ignore SIGINT, and `nohup` SIGHUP;
    # children inherit that (Python then installs no handler): the child gets the defaults back.
    def default_stops() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE)), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             preexec_fn=default_stops)
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
    from fakes import SUITE, run_cli, write_suite

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


@pytest.mark.slow
def test_sigkill_while_a_checkpoint_is_written_then_resume_matches_uninterrupted_run(
        tmp_path: Path) -> None:
    from fakes import PAUSE_SAVE_ENV, SUITE, run_cli, write_suite

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 3"))
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "5",
              "--device", "cpu", "--no-base-cache"]
    straight = tmp_path / "straight"
    assert run_cli(common + ["--out", str(straight)]).exit_code == 0

    # the second weights file written is stage 2's checkpoint: killed with it half in place
    killed = tmp_path / "killed"
    code, _ = _signal_mid_stage_2(common + ["--out", str(killed)], tmp_path, signal.SIGKILL,
                                  pause=(PAUSE_SAVE_ENV, "2"))
    assert code == -signal.SIGKILL
    assert (killed / "checkpoints" / "stage1" / "state.pt").is_file()  # the last whole one
    assert not (killed / "checkpoints" / "stage2").exists()  # never half a checkpoint
    res = run_cli(common + ["--out", str(killed), "--resume"])
    assert res.exit_code == 0, res.output
    assert "resuming after stage 1" in res.output
    a, b = read_results(straight / "results.json"), read_results(killed / "results.json")
    assert b.status == "complete" and b.score_matrix() == a.score_matrix()
    assert _items(killed) == _items(straight)
    assert [s.summary for s in b.stages] == [s.summary for s in a.stages]
    assert not [p for p in (killed / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130)])
def test_a_stop_mid_evaluation_keeps_the_trained_stage_and_the_saved_columns(
        tmp_path: Path, sig: int, code: int) -> None:
    from fakes import PAUSE_GRADE_ENV, SUITE, run_cli, write_suite

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 3"))
    # sampled evaluation: a column evaluated after the resume draws what it would have drawn
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "5",
              "--device", "cpu", "--no-base-cache", "--set", "protocol.decoding.temperature=1"]
    straight = tmp_path / "straight"
    assert run_cli(common + ["--out", str(straight)]).exit_code == 0

    # 3 columns x 6 items a row: the 6 * 3 + 6 * 3 + 6 + 6 + 1 = 49th grading is the first item
    # of row 2's last column, after stage 2 trained and its columns `low` and `high` were saved
    killed = tmp_path / "killed"
    exit_code, output = _signal_mid_stage_2(common + ["--out", str(killed)], tmp_path, sig,
                                            pause=(PAUSE_GRADE_ENV, "49"))
    assert exit_code == code, output
    if sig == signal.SIGINT:
        assert ("row 0 and stage 1 are saved, and stage 2 is trained (its evaluation continues "
                "where it stopped; 2 of 3 columns saved: low, high)") in " ".join(output.split())
    assert len(read_results(killed / "results.json").matrix) == 2  # base + stage 1
    assert (killed / "checkpoints" / "stage2" / "state.pt").is_file()
    assert not (killed / "checkpoints" / "stage1").exists()  # the trained stage 2 replaced it
    kept = {name: (killed / "items" / "row2" / f"{name}.jsonl").stat().st_mtime_ns
            for name in ("low", "high")}
    assert not (killed / "items" / "row2" / "all.jsonl").exists()

    res = run_cli(common + ["--out", str(killed), "--resume"])
    assert res.exit_code == 0, res.output
    assert "stage 2 was trained before the stop, its evaluation continues" in \
        " ".join(res.output.split())
    log = (killed / "run.log").read_text()
    assert log.count("stage 2 step") == 3  # trained once (3 steps), not again after the kill
    assert {name: (killed / "items" / "row2" / f"{name}.jsonl").stat().st_mtime_ns
            for name in kept} == kept  # the saved columns were not evaluated again
    a, b = read_results(straight / "results.json"), read_results(killed / "results.json")
    assert b.status == "complete"
    assert b.score_matrix() == a.score_matrix()
    assert [[c.model_dump() if c else None for c in row] for row in b.matrix] == \
        [[c.model_dump() if c else None for c in row] for row in a.matrix]  # intervals too
    assert _items(killed) == _items(straight)
    assert [s.summary for s in b.stages] == [s.summary for s in a.stages]


def test_resume_of_a_complete_run_reprints_without_training(tmp_path: Path) -> None:
    from fakes import SUITE, run_cli, write_suite

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
    (signal.SIGHUP, 143, "terminated"),    # the terminal closed
])
def test_a_stop_request_mid_stage_keeps_completed_stages(tmp_path: Path, sig: int, code: int,
                                                         word: str) -> None:
    from fakes import SUITE, run_cli, write_suite

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
    from clbench.run.rundir import saved_rows

    assert saved_rows(0, tmp_path) == (f"no row was complete yet (row 0, the base model, was being "
                                       f"evaluated) in {tmp_path}")
    assert saved_rows(1, tmp_path) == f"row 0 (the base model) is saved in {tmp_path}"
    assert saved_rows(2, tmp_path) == f"row 0 and stage 1 are saved in {tmp_path}"
    assert saved_rows(4, tmp_path) == f"row 0 and stages 1..3 are saved in {tmp_path}"
    assert saved_rows(1, tmp_path, trained=True) == (
        f"row 0 (the base model) is saved, and stage 1 is trained (its evaluation continues "
        f"where it stopped) in {tmp_path}")
    assert saved_rows(3, tmp_path, trained=True) == (
        f"row 0 and stages 1..2 are saved, and stage 3 is trained (its evaluation continues "
        f"where it stopped) in {tmp_path}")
    assert saved_rows(3, tmp_path, trained=True, saved_columns=["math", "science"],
                      columns=7) == (
        f"row 0 and stages 1..2 are saved, and stage 3 is trained (its evaluation continues "
        f"where it stopped; 2 of 7 columns saved: math, science) in {tmp_path}")
    assert saved_rows(0, tmp_path, saved_columns=["math"], columns=3) == (
        f"no row was complete yet (row 0, the base model, was being evaluated; 1 of 3 columns "
        f"saved: math) in {tmp_path}")


def test_report_says_where_a_run_that_is_not_complete_stands(tmp_path: Path) -> None:
    """A stopped run's report reads what is saved from its folder (the stop message's words),
    says when a process is running it now, and why a failed run stopped."""
    import json

    from fakes import SUITE, run_cli, write_suite
    from rich.console import Console

    from clbench.report.runs import report
    from clbench.results import write_results
    from clbench.run.rundir import lock_run_dir

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    out = tmp_path / "run"
    assert run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                    "--out", str(out)]).exit_code == 0
    result = read_results(out / "results.json")
    assert result.compute.wall_time_s > 0
    # as if stopped while evaluating stage 2, with one of its columns saved
    result.status, result.matrix, result.row_labels = "partial", result.matrix[:2], \
        result.row_labels[:2]
    write_results(out / "results.json", result)
    (out / "items" / "row2" / "cells.json").write_text(json.dumps(
        {"stamp": "s", "cells": {result.columns[0].name: {}}}))
    names = [c.name for c in result.columns]
    console = Console(record=True, width=300)
    (run,) = report([out], console=console)["runs"]
    expected = (f"partial: row 0 and stage 1 are saved, and stage 2 is trained (its evaluation "
                f"continues where it stopped; 1 of {len(names)} columns saved: {names[0]}) in "
                f"{out}")
    assert run["standing"] == expected
    text = console.export_text()
    assert expected in text
    assert "compute of the rows saved: 0:00:" in text  # not the whole work

    with lock_run_dir(out):  # a process running it now
        (run,) = report([out], console=console)["runs"]
    assert run["standing"] == expected.replace(
        "partial:", "partial (running now):").replace("continues where it stopped", "is under way")

    import io

    markdown = Console(file=io.StringIO(), width=300)
    report([out], console=markdown, as_markdown=True)
    assert f"Status: {expected}." in markdown.file.getvalue()
    assert "Compute of the rows saved: 0:00:" in markdown.file.getvalue()
    result.status, result.error = "failed", "stage 2: RuntimeError: out of memory"
    write_results(out / "results.json", result)
    copied = tmp_path / "copied.json"  # out of its folder: only what the file says
    copied.write_bytes((out / "results.json").read_bytes())
    assert [r["standing"] for r in report([out, copied], console=console)["runs"]] == [
        f"failed: stage 2: RuntimeError: out of memory; {expected.split(': ', 1)[1]}",
        "failed: stage 2: RuntimeError: out of memory; 2 rows of R"]


def test_a_row_resumes_from_its_saved_columns_and_only_from_sound_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from fakes import PLUGINS, run_spec, write_suite
    from rich.console import Console

    from clbench.eval.records import read_records, records_path, write_records
    from clbench.models import load_model
    from clbench.plugins import registry
    from clbench.progress import run_progress
    from clbench.run import baserow, rows
    from clbench.run.context import RunContext

    with registry.extra_plugins(**PLUGINS):
        run = run_spec(str(write_suite(tmp_path)), "test.echo-sft", seed=0,
                             out_dir=str(tmp_path / "r"), overrides=[])
        plans, _ = rows.plan_columns(run)
    model, tokenizer = load_model(run.model, device="cpu")
    run_dir = Path(run.out_dir)
    stamp = baserow.evaluation_stamp(run, plans, {"dtype": "float32", "device": "cpu"})
    def context(progress: object) -> RunContext:
        return RunContext(run=run, run_dir=run_dir, model=model, tokenizer=tokenizer,
                          progress=progress, plans=plans, stamp=stamp)

    with run_progress(Console(quiet=True)) as progress:
        cells = rows.evaluate_row(context(progress), 1)
    names = [p.name for p in plans]
    assert list(rows.saved_cells(run_dir, 1, plans, stamp)) == names
    assert [c.summary() for c in rows.saved_cells(run_dir, 1, plans, stamp).values()] == \
        [c.summary() for c in cells]

    def no_evaluation(*args: object, **kwargs: object) -> None:
        raise AssertionError("a saved column was evaluated again")

    monkeypatch.setattr(rows, "evaluate_column", no_evaluation)
    with run_progress(Console(quiet=True)) as progress:
        again = rows.evaluate_row(context(progress), 1)
    assert [(c.summary(), c.records) for c in again] == [(c.summary(), c.records) for c in cells]

    # records that are not the column's items (here: one item short) are not trusted
    low = records_path(run_dir, 1, "low")
    write_records(low, read_records(low)[:-1])
    assert list(rows.saved_cells(run_dir, 1, plans, stamp)) == names[1:]
    # cells saved under another stamp (here: another device kind; or an upgrade between the
    # stop and the resume) are not trusted
    on_gpu = baserow.evaluation_stamp(run, plans, {"dtype": "float32", "device": "cuda:0"})
    assert on_gpu != stamp and rows.saved_cells(run_dir, 1, plans, on_gpu) == {}
    saved_file = low.with_name(rows.CELLS_FILE)
    saved = json.loads(saved_file.read_text())
    saved_file.write_text("{damaged")
    assert rows.saved_cells(run_dir, 1, plans, stamp) == {}
    saved_file.write_text(json.dumps(saved))
    rows.forget_saved_cells(run_dir, 1)  # the stage is about to be trained again
    assert rows.saved_cells(run_dir, 1, plans, stamp) == {}
    assert rows.saved_cells(run_dir, 2, plans, stamp) == {}  # nothing saved for that row at all


def test_a_column_scored_nan_is_saved_and_kept_like_any_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An lm-eval score can be NaN (a diverged model's perplexity): saving the row's cells
    must not fail on it, and the saved NaN must come back as NaN."""
    import math

    from fakes import PLUGINS, run_spec, write_suite
    from rich.console import Console

    from clbench.eval.column import CellResult
    from clbench.eval.records import ItemRecord
    from clbench.plugins import registry
    from clbench.progress import run_progress
    from clbench.run import rows
    from clbench.run.context import RunContext

    with registry.extra_plugins(**PLUGINS):
        run = run_spec(str(write_suite(tmp_path)), "test.echo-sft", seed=0,
                             out_dir=str(tmp_path / "r"), overrides=[])
        plans, _ = rows.plan_columns(run)

    def nan_cell(column: str, task: object, examples: list, *args: object,
                 **kwargs: object) -> CellResult:
        records = [ItemRecord(ex.id, "", 0.0, False) for ex in examples]
        return CellResult(column, float("nan"), float("nan"), len(records), None, records)

    monkeypatch.setattr(rows, "evaluate_column", nan_cell)
    monkeypatch.setattr(rows, "run_generate_fn", lambda *args, **kwargs: (None, 16))
    with run_progress(Console(quiet=True)) as progress:
        rows.evaluate_row(RunContext(run=run, run_dir=Path(run.out_dir), model=None,
                                     tokenizer=None, progress=progress, plans=plans,
                                     stamp="stamp"), 1)
    saved = rows.saved_cells(Path(run.out_dir), 1, plans, "stamp")
    assert list(saved) == [p.name for p in plans]
    assert all(math.isnan(cell.score) for cell in saved.values())


def test_a_checkpoint_is_read_as_data_only(tmp_path: Path) -> None:
    """A stage checkpoint's state.pt that would unpickle an object (a run folder is a file from
    whoever made it) is refused with the file named, its code never run; one written by an
    earlier clbench (NumPy's RNG state as an array) still resumes."""
    import numpy as np
    import torch
    from fakes import SUITE, run_cli, write_suite

    from clbench.results import write_results

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 2"))
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu"]
    done = tmp_path / "done"
    assert run_cli([*common, "--out", str(done)]).exit_code == 0
    complete = read_results(done / "results.json")
    state_path = done / "checkpoints" / "stage2" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    # as if stopped while stage 2's row was evaluated: its checkpoint is loaded to go on
    partial = complete.model_copy(deep=True)
    partial.matrix, partial.row_labels = partial.matrix[:2], partial.row_labels[:2]
    partial.stages, partial.status, partial.metrics = partial.stages[:1], "partial", {}
    write_results(done / "results.json", partial)

    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({**state, "method": Hostile()}, state_path)
    res = run_cli([*common, "--out", str(done), "--resume"])
    assert res.exit_code == 2, res.output
    assert f"{state_path}: not a checkpoint clbench can read as data" in \
        " ".join(res.output.split())
    assert not marker.exists()

    name, keys, *rest = state["rng"]["numpy"]  # how checkpoints kept it before
    torch.save({**state, "rng": {**state["rng"], "numpy": (name, np.asarray(
        keys, dtype=np.uint32), *rest)}}, state_path)
    res = run_cli([*common, "--out", str(done), "--resume"])
    assert res.exit_code == 0, res.output
    assert read_results(done / "results.json").score_matrix() == complete.score_matrix()
