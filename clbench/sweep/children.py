"""A sweep's runs as child processes, up to N at a time (`clbench sweep --jobs N`).

Each run is a `clbench run ... --resume` child with its own session, logging to
`<out_root>/logs/<method>-s<seed>.log` (appended, so a resumed run keeps its history), never
into the run directory, which refuses anything but a clbench run. This module starts them,
watches them (a live table where live displays are drawn, a line per finished stage elsewhere),
stops them all on Ctrl-C, SIGTERM or SIGHUP (each saves what it has done) and reports the
ones that failed with the end of their logs. On Linux a child also gets SIGTERM when the sweep
dies of a SIGKILL, which the sweep itself cannot catch, and each child watches for its sweep's
end itself (:func:`stop_when_sweep_ends`), so no child outlives the sweep.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from clbench.errors import (
    Terminated,
    UserError,
    hangup_as_termination,
    stop_of,
    stop_requests,
    stops_deferred,
    terminate_as_interrupt,
)
from clbench.progress import clock_time, draws_live
from clbench.results import RESULTS_FILENAME
from clbench.run.recipe import RunInterrupted
from clbench.run.rundir import what_is_saved
from clbench.spec.options import RunOptions
from clbench.spec.schema import RunSpec

#: Seconds between looks at the children (exit status, results.json) while they run.
POLL_SECONDS = 1.0
#: Seconds a child gets to save and exit after SIGTERM before it is killed.
STOP_GRACE_SECONDS = 30.0
#: prctl option: the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG = 1
#: Lines of a failed child's log shown at the end of the sweep.
LOG_TAIL_LINES = 12
#: The environment variable that tells a child run the process id of the sweep that started it.
SWEEP_PID_VARIABLE = "CLBENCH_SWEEP_PID"
#: Seconds between a child's looks at whether its sweep is still there.
WATCH_SECONDS = 1.0



def stage_count(run: RunSpec) -> int:
    """Stages the run trains (a joint run: one)."""
    return 1 if getattr(run, "joint", False) else len(run.suite.stages)


@dataclass
class ChildLauncher:
    """How a child process of the sweep is started: its command, environment and log file."""

    out_root: Path
    threads: int | None = None  # OMP_NUM_THREADS of each child; None: the sweep's environment

    def command(self, child: Child) -> list[str]:
        """`clbench run` for the child's run; --resume starts fresh in an empty or missing
        directory and continues a partial one."""
        return [sys.executable, "-m", "clbench.cli", "run", *child.options.command_line(),
                "--resume"]

    def environment(self) -> dict[str, str]:
        """The sweep's environment with the child's thread count."""
        env = dict(os.environ)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        env["PYTHONUNBUFFERED"] = "1"  # the log shows progress as it happens
        env[SWEEP_PID_VARIABLE] = str(os.getpid())  # the child stops when the sweep is gone
        env.setdefault("COLUMNS", "160")  # a file is 80 columns to rich: tables would wrap
        return env

    def log_path(self, run: RunSpec) -> Path:
        return self.out_root / "logs" / f"{run.folder_name()}-s{run.seed}.log"

    def start(self, child: Child) -> subprocess.Popen[bytes]:
        command, log_path = self.command(child), child.log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} "
                      f"{shlex.join(command)}\n".encode())
            log.flush()
            # Own session: a Ctrl-C at the terminal reaches the sweep alone, which then stops
            # every child with one SIGTERM (two signals could cut a child's saving short).
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self.environment(),
                                    start_new_session=True,
                                    preexec_fn=functools.partial(terminate_with_parent,
                                                                 os.getpid()))


def terminate_with_parent(parent: int) -> None:
    """Run in a child before it starts (Linux): SIGTERM it when the sweep dies, even by SIGKILL,
    which the sweep cannot catch, so that no run is left training unsupervised; the child then
    stops cleanly, as on any SIGTERM. Elsewhere nothing happens."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the sweep died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def stop_when_sweep_ends(sweep_pid: int | None = None, every: float = WATCH_SECONDS,
                         again: float = 2 * STOP_GRACE_SECONDS) -> bool:
    """In a child run of a sweep (`sweep_pid`, else the one named by the environment variable
    the sweep sets): a daemon thread that sends this process SIGTERM once its parent is no
    longer that sweep (unless a stop has arrived: the parent-death signal's), which then stops
    cleanly as on any SIGTERM, and again every `again` seconds while it lives. The
    parent-death signal does this on Linux alone, and once: where Python could not raise the
    stop (a signal that lands inside a finalizer is only printed) the run would train on
    unsupervised. False, and nothing watched, outside a sweep's child."""
    if sweep_pid is None:
        try:
            sweep_pid = int(os.environ.get(SWEEP_PID_VARIABLE, ""))
        except ValueError:
            return False
    if os.getppid() != sweep_pid:  # started by something else, or the sweep is already gone
        return False

    stops = stop_requests()

    def watch() -> None:
        while os.getppid() == sweep_pid:
            time.sleep(every)
        time.sleep(every)  # a parent-death signal, where there is one, has been handled by now
        if stop_requests() == stops:  # a second stop at once would cut the first's saving short
            os.kill(os.getpid(), signal.SIGTERM)
        while True:
            time.sleep(again)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="clbench-sweep-watch", daemon=True).start()
    return True


def threads_per_child(device: str, parallel: int) -> int | None:
    """On the CPU, unless the user set OMP_NUM_THREADS, each of `parallel` children gets an
    equal share of the cores: N runs each using every core would oversubscribe them. None
    (leave the environment alone) on a GPU or when the user chose."""
    from clbench.models import resolve_device
    from clbench.train.cpu import run_threads

    return run_threads(parallel) if resolve_device(device).type == "cpu" else None


@dataclass
class Child:
    """One run of the grid on its way through a child process."""

    options: RunOptions  # what asks for the run (`--out` set)
    run: RunSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started: float | None = None
    ended: float | None = None
    state: str = "waiting"  # running, complete, failed, interrupted
    code: int | None = None  # exit status

    @property
    def name(self) -> str:
        return f"{self.run.folder_name()} seed {self.run.seed}"

    def finish(self, code: int, stopped: bool = False) -> None:
        """Record the exit status; `stopped`: the sweep stopped it (a kill is no failure)."""
        self.ended, self.code = time.monotonic(), code
        stopped = stopped or code in (130, Terminated.exit_code, -signal.SIGTERM, -signal.SIGINT)
        self.state = "complete" if code == 0 else "interrupted" if stopped else "failed"

    def rows_done(self) -> int | None:
        """Complete rows of R in results.json (row 0 is the base model), None while there is no
        readable one (not written yet: it is written atomically, never half)."""
        try:
            path = Path(self.run.out_dir) / RESULTS_FILENAME
            matrix = json.loads(path.read_text(encoding="utf-8")).get("matrix")
        except (OSError, ValueError, AttributeError):
            return None
        return len(matrix) if isinstance(matrix, list) else None

    def stages_done(self) -> str:
        """`done/T`, `-/T` before row 0 exists."""
        rows = self.rows_done()
        return f"{'-' if not rows else rows - 1}/{stage_count(self.run)}"

    def elapsed(self) -> str:
        if self.started is None:
            return ""
        return clock_time((self.ended or time.monotonic()) - self.started)


STATE_STYLE = {"waiting": "dim", "running": "cyan", "complete": "green", "failed": "red",
               "interrupted": "yellow"}


def progress_table(children: Sequence[Child]) -> Table:
    table = Table(title="sweep", title_justify="left")
    for column in ("method", "seed", "state", "stages", "elapsed"):
        table.add_column(column, justify="right" if column in ("seed", "elapsed") else "left")
    for c in children:
        style = STATE_STYLE[c.state]
        table.add_row(escape(c.run.folder_name()), str(c.run.seed), f"[{style}]{c.state}[/]",
                      c.stages_done(), c.elapsed())
    return table


def run_as_children(runs: Sequence[tuple[RunOptions, RunSpec]], launch: ChildLauncher,
                    jobs: int, console: Console) -> list[Child]:
    """Run each run in a child process, up to `jobs` at once, with a live table; return the
    children whose run did not complete: failed, or stopped by a signal from outside the sweep.
    On Ctrl-C or SIGTERM every child is stopped and RunInterrupted raised; whatever happens, no
    child is left running."""
    children = [Child(options, run, launch.log_path(run)) for options, run in runs]
    stop: KeyboardInterrupt | None = None
    try:
        # SIGTERM is handled here too, not only by the CLI: a caller of the library that left it
        # at its default would die at once and leave the children (own sessions) running.
        with terminate_as_interrupt(), hangup_as_termination(), \
                Live(progress_table(children), console=console, auto_refresh=False) as live:
            try:
                _supervise(children, launch, jobs, console, live)
            except KeyboardInterrupt as exc:
                stop = exc
                console.print(f"[yellow]{stop_of(exc)[0]}: stopping the running runs (each "
                              "saves what it has done)[/]")
                stop_children(children)
                live.update(progress_table(children), refresh=True)
        if not draws_live(console):
            console.line()  # Live ends its last frame with a newline on a terminal only
    finally:
        stop_children(children)  # after anything else (a bug, a second Ctrl-C): none left running
    if stop is not None:
        raise RunInterrupted.after(stop, "what every run had done is saved under "
                                   f"{launch.out_root}. Continue with the same command")
    return [c for c in children if c.state != "complete"]


def stage_news(children: Sequence[Child], said: dict[int, int]) -> list[str]:
    """A line for each running child with more complete rows of R than `said` (the rows at its
    launch or when last said, by position; updated; a child not in it is noted, not announced),
    for a console where the live table is not drawn."""
    lines = []
    for i, child in enumerate(children):
        rows = child.rows_done() if child.state == "running" else None
        if rows is None:
            continue
        before = said.setdefault(i, rows)
        if rows <= before:
            continue
        said[i] = rows
        total = stage_count(child.run)
        what = "row 0 (base model) ready" if rows == 1 else f"stage {rows - 1}/{total} done"
        lines.append(f"{child.name}: {what}, {child.elapsed()} since it started")
    return lines


def _supervise(children: Sequence[Child], launch: ChildLauncher, jobs: int, console: Console,
               live: Live) -> None:
    waiting = list(children)
    said: dict[int, int] = {}
    while True:
        if not draws_live(console):  # no live table there: say each finished stage instead
            for line in stage_news(children, said):
                console.print(escape(line), soft_wrap=True, highlight=False)
        for child in children:
            if child.state == "running" and child.process is not None:
                code = child.process.poll()
                if code is not None:
                    child.finish(code)
                    colour = STATE_STYLE[child.state]
                    console.print(f"[{colour}]{escape(child.name)}: {child.state}"
                                  + ("" if code == 0 else f" (exit {code})") + "[/]")
        while waiting and sum(c.state == "running" for c in children) < jobs:
            child = waiting.pop(0)
            rows = child.rows_done()  # before it starts: what it continues from
            columns = len(child.run.suite.stages) + len(child.run.suite.probes)
            what = "started" if rows is None else \
                f"resumed ({what_is_saved(Path(child.run.out_dir), rows, columns)})"
            with stops_deferred():  # a child that is started is a child that will be stopped
                child.process = launch.start(child)
                child.state, child.started = "running", time.monotonic()
            said[children.index(child)] = rows or 0  # a resumed run's rows are old
            console.print(f"{escape(child.name)}: {escape(what)}, log "
                          f"{escape(str(child.log_path))}", soft_wrap=True)
        live.update(progress_table(children), refresh=True)
        if not waiting and not any(c.state == "running" for c in children):
            return
        time.sleep(POLL_SECONDS)


def stop_children(children: Sequence[Child], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to every running child, wait up to `grace` seconds, then kill what is left. A
    second Ctrl-C or SIGTERM while waiting kills them at once."""
    running = [c for c in children if c.state == "running" and c.process is not None]
    signalled = []
    for child in running:
        assert child.process is not None
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            signalled.append(child)
    try:
        deadline = time.monotonic() + grace
        for child in signalled:
            assert child.process is not None
            with contextlib.suppress(subprocess.TimeoutExpired):  # killed below
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for child in running:
            assert child.process is not None
            if child.process.poll() is None:
                child.process.kill()
            child.finish(child.process.wait(), stopped=child in signalled)


def report_failures(failed: Sequence[Child], total: int, console: Console) -> None:
    """Each run that failed (or was stopped from outside the sweep) with the end of its log,
    then the UserError that names them all."""
    for child in failed:
        console.rule(f"[red]{escape(child.name)} {child.state}[/]")
        console.print(f"log: {escape(str(child.log_path))}", soft_wrap=True)
        try:
            lines = child.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines[-LOG_TAIL_LINES:]:
            console.print(escape(line), soft_wrap=True, highlight=False)
    names = "; ".join(f"{c.name} ({_stop_note(c)}log {c.log_path})" for c in failed)
    raise UserError(f"{len(failed)} of {total} runs failed: {names}")


def _stop_note(child: Child) -> str:
    """What to say of a child that a signal from outside the sweep stopped (else nothing)."""
    if child.state != "interrupted":
        return ""
    return f"stopped by a signal from outside the sweep, exit {child.code}; "
