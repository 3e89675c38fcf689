"""`clbench sweep --jobs N`: runs of the grid as child processes, side by side.

The children are real `clbench run` processes, so the grid uses built-in plugins (the smoke
suite, method `sft`) that a fresh interpreter finds. They run with OMP_NUM_THREADS=1, as the
in-process reference does, so the arithmetic, and hence every score, is the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from where import SMOKE

from clbench.cli import cli
from clbench.errors import UserError, terminate_as_interrupt
from clbench.results import read_results, write_results
from clbench.run.recipe import RunInterrupted
from clbench.spec.options import RunOptions, RunSettings
from clbench.sweep import children as sweep_children
from clbench.sweep import grid as sweep_module
from clbench.sweep.children import Child, ChildLauncher, threads_per_child
from clbench.sweep.grid import grid_run, sweep
from clbench.train import cpu

SEEDS = (0, 1)


def run_dir(root: Path, seed: int) -> Path:
    return root / "sft" / f"s{seed}"


def items(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text()
            for p in sorted((folder / "items").rglob("*.jsonl"))}


def sweep_cli(root: Path, seeds: str, *extra: str) -> Result:
    return CliRunner(env={"COLUMNS": "200"}).invoke(cli, [
        "sweep", "--suite", "smoke", "--methods", "sft", "--seeds", seeds, "--out", str(root),
        "--device", "cpu", "--jobs", "2", *extra])


@pytest.fixture(scope="module")
def in_process_grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """sft x seeds 0, 1 on the smoke suite, run one after another in this process (--jobs 1),
    with row 0 evaluated rather than taken from a cache."""
    root = tmp_path_factory.mktemp("in-process") / "grid"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CLBENCH_BASE_ROWS", str(tmp_path_factory.mktemp("base-rows")))
            sweep("smoke", ["sft"], SEEDS, root, RunSettings(device="cpu", reuse_base_row=False))
    finally:
        torch.set_num_threads(threads)
    yield root


@pytest.fixture(autouse=True)
def one_thread_per_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# ---------------------------------------------------------------------------------------------
# The child's command and environment
# ---------------------------------------------------------------------------------------------

def test_child_command_carries_every_option_of_the_sweep(tmp_path: Path) -> None:
    settings = RunSettings(sets=["method.lr=2e-5"], addons=["replay"], model="tiny-llama",
                           device="cpu", reuse_base_row=False, checkpoint_minutes=2.5)
    options, run = grid_run(RunOptions.of(settings, suite="smoke", method="sft", seed=3),
                            tmp_path)
    assert run.out_dir == str(tmp_path / "sft+replay" / "s3")
    launch = ChildLauncher(tmp_path, threads=4)
    child = Child(options, run, launch.log_path(run))
    command = launch.command(child)
    assert command[:4] == [sys.executable, "-m", "clbench.cli", "run"]
    args = " ".join(command[4:])
    assert f"--suite {run.suite_file} --method sft --seed 3 --device cpu --checkpoint-minutes " \
           f"2.5 --out {tmp_path}/sft+replay/s3 --addon replay --set method.lr=2e-5 --model " \
           "tiny-llama --no-base-cache --resume" == args
    # the child's command builds the very same run
    from click.testing import CliRunner

    from clbench.cli import cli
    from clbench.plugins.runspec import build_run_spec

    assert build_run_spec(options) == run
    assert CliRunner().invoke(cli, ["run", *command[4:], "--plan"]).exit_code == 0
    assert launch.log_path(run) == tmp_path / "logs" / "sft+replay-s3.log"
    env = launch.environment()
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert env["CLBENCH_SWEEP_PID"] == str(os.getpid())  # the child watches for its end


# A sweep's child stand-in: the sweep watch on, a SIGTERM handler that counts the stops (in the
# file argv[1]) and returns, as a stop lost inside a finalizer would, until the argv[2]-th.
_WATCHED_CHILD = '''
import os, signal, sys, time
from pathlib import Path
from clbench.sweep.children import stop_when_sweep_ends
stops = []
def on_stop(signum, frame):
    stops.append(signum)
    Path(sys.argv[1]).write_text(str(len(stops)))
    if len(stops) == int(sys.argv[2]):
        os._exit(0)
signal.signal(signal.SIGTERM, on_stop)
print(stop_when_sweep_ends(every=0.05, again=0.5), flush=True)
time.sleep(60)
'''
# The sweep's stand-in: starts the child with its own pid in the environment (and no
# parent-death signal), says the child's pid, then waits to be killed.
_SWEEP = '''
import os, subprocess, sys, time
env = dict(os.environ, CLBENCH_SWEEP_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env)
print(child.pid, flush=True)
time.sleep(60)
'''


def test_a_child_stops_itself_when_its_sweep_is_gone_and_asks_again(tmp_path: Path) -> None:
    stops = tmp_path / "stops"
    sweep_process = subprocess.Popen(
        [sys.executable, "-c", _SWEEP, _WATCHED_CHILD, str(stops), "2"],
        stdout=subprocess.PIPE, text=True)
    assert sweep_process.stdout is not None
    child = int(sweep_process.stdout.readline())
    try:
        assert sweep_process.stdout.readline().strip() == "True"  # the child's: it watches
        time.sleep(0.5)
        assert not stops.exists()  # ten looks at a sweep that is there: no stop
        sweep_process.kill()  # as SIGKILL does: nothing the sweep can catch
        sweep_process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
        assert stops.read_text() == "2"  # the first stop was lost, the second ended it
    finally:
        sweep_process.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_run_outside_a_sweep_watches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLBENCH_SWEEP_PID", raising=False)
    assert sweep_children.stop_when_sweep_ends() is False
    monkeypatch.setenv("CLBENCH_SWEEP_PID", str(os.getpid()))  # not this process's parent
    assert sweep_children.stop_when_sweep_ends() is False


def test_cpu_threads_are_shared_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    assert threads_per_child("cpu", 2) is None  # OMP_NUM_THREADS=1 is set (autouse fixture)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_child("cpu", 1) == cpu.available_cpus()
    monkeypatch.setattr(cpu, "available_cpus", lambda: 16)
    assert [threads_per_child("cpu", n) for n in (1, 2, 3, 16, 40)] == [16, 8, 5, 1, 1]


def test_jobs_below_one_and_multi_process_launches_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = sweep_cli(tmp_path / "grid", "0", "--jobs", "0")
    assert res.exit_code == 2 and "0 is not in the range x>=1" in res.output
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch / torchrun set it
    res = sweep_cli(tmp_path / "grid", "0")
    assert res.exit_code == 2 and "multi-process launch" in res.output
    assert not (tmp_path / "grid").exists()


# ---------------------------------------------------------------------------------------------
# Sweeps with child processes
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_jobs_2_gives_the_results_of_the_in_process_sweep(tmp_path: Path,
                                                          in_process_grid: Path) -> None:
    root = tmp_path / "grid"
    res = sweep_cli(root, "0,1", "--no-base-cache")
    assert res.exit_code == 0, res.output
    for seed in SEEDS:
        there, here = run_dir(in_process_grid, seed), run_dir(root, seed)
        a, b = read_results(there / "results.json"), read_results(here / "results.json")
        assert b.status == "complete"
        assert a.score_matrix() == b.score_matrix()
        assert {k: v.value for k, v in a.metrics.items()} == \
            {k: v.value for k, v in b.metrics.items()}
        assert items(there) == items(here)
        log = (root / "logs" / f"sft-s{seed}.log").read_text()
        assert f"--seed {seed} " in log and f"--out {here} " in log and "--resume" in log
        assert "after science" in log
        assert f"sft seed {seed}: complete" in res.output
    assert "mean ± std over seeds" in res.output and "(n=2)" in res.output
    assert sorted(p.name for p in root.iterdir()) == ["logs", "sft"]  # logs outside run dirs


def test_complete_runs_are_skipped_not_relaunched(tmp_path: Path, in_process_grid: Path) -> None:
    root = tmp_path / "grid"
    shutil.copytree(in_process_grid, root)
    before = {s: (run_dir(root, s) / "results.json").read_bytes() for s in SEEDS}
    res = sweep_cli(root, "0,1,1")  # a seed given twice is one run
    assert res.exit_code == 0, res.output
    assert "skip sft seed 0: complete" in res.output
    assert res.output.count("skip sft seed 1: complete") == 1
    assert {s: (run_dir(root, s) / "results.json").read_bytes() for s in SEEDS} == before
    assert not (root / "logs").exists() and "started" not in res.output  # no child
    assert "(n=2)" in res.output


def _break_seed_1(root: Path) -> None:
    """Seed 1 looks resumable to the sweep (its own run, stage 1 of 2 done) but has lost its
    checkpoints (stage 1's was pruned when stage 2 was trained): the run fails loading it."""
    shutil.rmtree(run_dir(root, 1) / "checkpoints")
    broken = read_results(run_dir(root, 1) / "results.json")
    broken.status = "partial"
    broken.matrix, broken.row_labels, broken.stages = \
        broken.matrix[:2], broken.row_labels[:2], broken.stages[:1]
    write_results(run_dir(root, 1) / "results.json", broken)


def test_a_failed_child_leaves_the_others_and_is_named_with_its_log(
        tmp_path: Path, in_process_grid: Path) -> None:
    root = tmp_path / "grid"
    shutil.copytree(in_process_grid, root)
    _break_seed_1(root)
    complete = (run_dir(root, 0) / "results.json").read_bytes()

    res = sweep_cli(root, "0,1,2")
    assert res.exit_code == 2, res.output
    log = root / "logs" / "sft-s1.log"
    assert f"1 of 3 runs failed: sft seed 1 (log {log})" in " ".join(res.stderr.split())
    assert "checkpoint" in log.read_text() and "cannot be resumed" in log.read_text()
    assert "cannot be resumed" in res.stdout  # the end of the log is shown
    out = " ".join(res.stdout.split())
    assert f"sft seed 1: resumed (row 0 and stage 1 are saved in {run_dir(root, 1)})" in out
    assert "sft seed 2: started" in out
    assert read_results(run_dir(root, 2) / "results.json").status == "complete"
    assert (run_dir(root, 0) / "results.json").read_bytes() == complete  # skipped
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["sft-s1.log", "sft-s2.log"]
    assert "(n=2)" in res.stdout  # seeds 0 and 2 are compared


def test_a_failed_run_in_process_leaves_the_others_and_fails_the_sweep(
        tmp_path: Path, in_process_grid: Path) -> None:
    """--jobs 1 ends like --jobs N: the rest of the grid runs, the comparison is printed, and
    the sweep exits non-zero naming the failed run."""
    root = tmp_path / "grid"
    shutil.copytree(in_process_grid, root)
    _break_seed_1(root)

    res = sweep_cli(root, "0,1,2", "--jobs", "1")
    assert res.exit_code == 2, res.output
    message = " ".join(res.stderr.split())
    assert "1 of 3 runs failed: sft seed 1 (" in message and "cannot be resumed" in message
    assert f"log {run_dir(root, 1) / 'run.log'}" in message
    assert read_results(run_dir(root, 2) / "results.json").status == "complete"
    assert "(n=2)" in res.stdout and not (root / "logs").exists()


@pytest.mark.parametrize("ending", ["sys.exit(143)", "os.kill(os.getpid(), signal.SIGTERM)"])
def test_a_child_stopped_from_outside_the_sweep_fails_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    """A child that ends as a stopped `clbench run` does (exit 143) or is killed by SIGTERM,
    without the sweep having stopped it, left its run incomplete: the sweep must not exit 0."""
    monkeypatch.setattr(sweep_children, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(ChildLauncher, "command", lambda self, run: [
        sys.executable, "-c", f"import os, signal, sys; {ending}"])
    with pytest.raises(UserError, match=r"1 of 1 runs failed: sft seed 0 \(stopped by a signal "
                                        r"from outside the sweep, exit (143|-15); log "):
        sweep("smoke", ["sft"], [0], tmp_path / "grid", RunSettings(device="cpu"), jobs=2)


def test_a_stop_as_a_child_starts_still_stops_that_child(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM between the child's start and the sweep recording it must not leave the child
    running (it is in its own session: nothing else would stop it)."""
    monkeypatch.setattr(sweep_children, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(ChildLauncher, "command", lambda self, run: [
        sys.executable, "-c", "import time; time.sleep(60)"])
    real, started = ChildLauncher.start, []

    def start_then_terminate(self: ChildLauncher, run):
        process = real(self, run)
        started.append(process)
        os.kill(os.getpid(), signal.SIGTERM)  # as if it came just as Popen returned
        return process

    monkeypatch.setattr(ChildLauncher, "start", start_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with terminate_as_interrupt(), pytest.raises(RunInterrupted):
            sweep("smoke", ["sft"], [0], tmp_path / "grid", RunSettings(device="cpu"), jobs=2)
        assert len(started) == 1 and started[0].poll() is not None
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_an_unknown_lm_eval_probe_stops_the_sweep_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_child(self: ChildLauncher, run):
        raise AssertionError("a run was started")

    monkeypatch.setattr(ChildLauncher, "start", no_child)
    smoke = SMOKE.read_text()
    suite = tmp_path / "probed.yaml"
    suite.write_text(smoke.replace("protocol:", (
        "  - name: general\n    kind: general\n    lm_eval: {task: clbench_general_mcq}\n"
        "protocol:")))
    res = CliRunner().invoke(cli, ["sweep", "--suite", str(suite), "--methods", "sft",
                                   "--seeds", "0,1", "--out", str(tmp_path / "grid"),
                                   "--device", "cpu", "--jobs", "2"])
    assert res.exit_code == 2, res.output
    assert "lm-eval task 'clbench_general_mcq' is unknown" in " ".join(res.output.split())
    assert not (tmp_path / "grid").exists()


def test_a_run_that_fails_before_it_starts_names_no_log(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(run, resume, console):
        raise UserError("refused before the run began")

    monkeypatch.setattr(sweep_module, "execute", refuse)
    with pytest.raises(UserError) as err:
        sweep("smoke", ["sft"], [0], tmp_path / "grid", RunSettings(device="cpu"), jobs=1)
    assert str(err.value) == "1 of 1 runs failed: sft seed 0 (refused before the run began)"


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stages_done(folder: Path) -> int:
    try:
        return len(json.loads((folder / "results.json").read_text())["matrix"]) - 1
    except (OSError, ValueError):
        return -1


def _sweep_in_stage_2(root: Path) -> subprocess.Popen:
    """A `sweep --jobs 2` child process whose two runs have finished stage 1 (stage 2 lasts
    until a signal)."""
    sweep_process = subprocess.Popen(
        [sys.executable, "-m", "clbench.cli", "sweep", "--suite", "smoke", "--methods", "sft",
         "--seeds", "0,1", "--out", str(root), "--device", "cpu", "--jobs", "2",
         "--set", "stages[1].budget.steps=100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not all(_stages_done(run_dir(root, s)) == 1 for s in SEEDS):
        if sweep_process.poll() is not None or time.monotonic() > deadline:
            sweep_process.kill()
            pytest.fail(f"the children never finished stage 1: {sweep_process.communicate()}")
        time.sleep(0.2)
    return sweep_process


@pytest.mark.slow
def test_a_sweep_killed_by_sigkill_leaves_no_run_training(tmp_path: Path) -> None:
    """SIGKILL cannot be caught by the sweep; its children get SIGTERM from the kernel when it
    dies (Linux) and stop cleanly, keeping what they had done."""
    root = tmp_path / "grid"
    sweep_process = _sweep_in_stage_2(root)
    children = _children_of(sweep_process.pid)
    assert len(children) == 2
    try:
        sweep_process.kill()
        sweep_process.wait(timeout=30)
        deadline = time.monotonic() + 120
        while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    for seed in SEEDS:
        log = (root / "logs" / f"sft-s{seed}.log").read_text()
        assert "terminated; row 0 and stage 1 are saved" in log  # a clean stop, not a kill
        assert len(read_results(run_dir(root, seed) / "results.json").matrix) == 2


@pytest.mark.slow
def test_sigterm_stops_every_child_and_exits_143(tmp_path: Path) -> None:
    root = tmp_path / "grid"
    sweep_process = _sweep_in_stage_2(root)
    children: list[int] = []
    try:
        children = _children_of(sweep_process.pid)
        assert len(children) == 2
        sweep_process.send_signal(signal.SIGTERM)
        out, err = sweep_process.communicate(timeout=120)
    finally:
        if sweep_process.poll() is None:
            sweep_process.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert sweep_process.returncode == 143, (out, err)
    assert not [pid for pid in children if _alive(pid)]
    assert "terminated; what every run had done is saved" in err
    assert "Continue with the same command" in err
    assert out.count("interrupted") >= 2  # both children, in the final table
    for seed in SEEDS:
        result = read_results(run_dir(root, seed) / "results.json")
        assert result.status == "partial" and len(result.matrix) == 2  # stage 1 kept
        log = (root / "logs" / f"sft-s{seed}.log").read_text()
        assert "terminated; row 0 and stage 1 are saved" in log


def test_a_sweep_without_a_terminal_says_each_finished_stage(tmp_path: Path) -> None:
    """Where the live table is not drawn (a log file), a line says when a run's row 0 or a
    stage is done; nothing is said twice, nor for runs that are not running."""
    import json
    from types import SimpleNamespace

    from clbench.sweep.children import Child, stage_news

    def child(seed: int, rows: int | None, state: str = "running") -> Child:
        out = tmp_path / f"s{seed}"
        out.mkdir()
        if rows is not None:
            (out / "results.json").write_text(json.dumps({"matrix": [[0.5]] * rows}))
        run = SimpleNamespace(method=SimpleNamespace(name="grpo"), seed=seed, out_dir=str(out),
                              suite=SimpleNamespace(stages=[1, 2, 3]), folder_name=lambda: "grpo")
        return Child(None, run, out / "log", state=state, started=0.0)  # type: ignore[arg-type]

    children = [child(0, None), child(1, 2), child(2, 4, state="complete"), child(3, None)]
    said = {0: 0, 1: 2}  # rows at launch: seed 1 resumed after stage 1; seed 3 not noted yet
    assert stage_news(children, said) == []
    (tmp_path / "s0" / "results.json").write_text(json.dumps({"matrix": [[0.5]]}))
    (tmp_path / "s1" / "results.json").write_text(json.dumps({"matrix": [[0.5]] * 3}))
    (tmp_path / "s3" / "results.json").write_text(json.dumps({"matrix": [[0.5]] * 2}))
    news = stage_news(children, said)
    assert [line.split(",")[0] for line in news] == [
        "grpo seed 0: row 0 (base model) ready", "grpo seed 1: stage 2/3 done"]
    assert stage_news(children, said) == []
    for damaged in ('{"matrix": null}', "[1]", "{not json"):  # never a crash, never a step back
        (tmp_path / "s1" / "results.json").write_text(damaged)
        assert stage_news(children, said) == [] and children[1].stages_done() == "-/3"
