"""A sweep's runs as cluster jobs through submitit (`clbench sweep --launcher submitit`).

Each run of the grid is one job, submitted together as a job array (at most
`array_parallelism` at once on Slurm). A job runs `clbench run ... --resume` as a child process,
so a job that starts again continues its run where it stopped. When Slurm preempts a job or its
time runs out, submitit signals it; the job then stops the run with SIGTERM (a run saves what it
has and exits cleanly on SIGTERM) and asks submitit to requeue it: the same job resumes its run.
On the `local` cluster (submitit's, for a workstation and the tests) the jobs are processes of
this machine.

The sweep records its jobs in `<out>/sweep-jobs.json` and waits for them, showing each change of
state, then compares the runs as any sweep does. Stopping the wait (Ctrl-C) leaves Slurm's jobs
running; `clbench sweep --status --out OUT` shows where each run is (queued, running, done,
failed) from the run folders and the cluster, and `clbench report OUT` compares what finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clbench.errors import UserError
from clbench.results import RESULTS_FILENAME, read_results
from clbench.spec.options import RunOptions
from clbench.spec.schema import RunSpec
from clbench.sweep.children import threads_per_child

#: The sweep's record of its jobs, in its root folder.
JOBS_FILE = "sweep-jobs.json"
#: submitit's folder (job scripts, pickles, each job's stdout and stderr), in the root folder.
SUBMITIT_FOLDER = "submitit"
#: Seconds a run gets to save and exit after SIGTERM when its job is preempted.
STOP_GRACE_SECONDS = 60.0
POLL_SECONDS = 2.0

Cluster = Literal["slurm", "local", "debug"]


@dataclass(frozen=True)
class ClusterSettings:
    """Where and how the jobs run: submitit's cluster and the Slurm parameters users set."""

    cluster: Cluster = "slurm"
    partition: str | None = None
    gpus_per_node: int = 1
    cpus_per_task: int | None = None
    time_minutes: int = 24 * 60
    mem_gb: int | None = None
    array_parallelism: int = 8
    account: str | None = None

    def parameters(self) -> dict[str, Any]:
        """submitit's executor parameters (the `slurm_` ones ignored by other clusters)."""
        out: dict[str, Any] = {"timeout_min": self.time_minutes, "name": "clbench-sweep",
                               "slurm_array_parallelism": self.array_parallelism}
        if self.cluster == "slurm":
            out["gpus_per_node"] = self.gpus_per_node
            out["slurm_signal_delay_s"] = int(STOP_GRACE_SECONDS) + 30
            for key, value in (("slurm_partition", self.partition),
                               ("slurm_account", self.account),
                               ("cpus_per_task", self.cpus_per_task), ("mem_gb", self.mem_gb)):
                if value is not None:
                    out[key] = value
        elif self.cpus_per_task is not None:
            out["cpus_per_task"] = self.cpus_per_task
        return out


class RunJob:
    """One run as a submitit job: `clbench run ARGS --resume` as a child process. Picklable
    (what submitit sends to the node): the child exists only while the job runs."""

    def __init__(self, args: Sequence[str], threads: int | None = None) -> None:
        self.args = list(args)
        self.threads = threads
        self._child: subprocess.Popen[bytes] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"args": self.args, "threads": self.threads, "_child": None}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "clbench.cli", "run", *self.args, "--resume"]

    def __call__(self) -> str:
        """Run (or continue) the run; its results file's path, or an error with the reason."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        self._child = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, env=env)
        # polled, not waited on: submitit's signal handler (`checkpoint`) waits for the child,
        # which a blocking wait here would keep from reaping it
        while (code := self._child.poll()) is None:
            time.sleep(0.5)
        out = self.args[self.args.index("--out") + 1]
        if code != 0:
            raise RuntimeError(f"clbench run exited with status {code} (its log: {out}/run.log)")
        return str(Path(out) / RESULTS_FILENAME)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook on preemption or timeout: stop the run so that it saves, then
        requeue this job, which resumes it."""
        import submitit

        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
        return submitit.helpers.DelayedSubmission(RunJob(self.args, self.threads))


def executor(out_root: Path, settings: ClusterSettings) -> Any:
    """submitit's executor for `settings.cluster`, its files under `out_root/submitit`."""
    try:
        import submitit
    except ModuleNotFoundError:
        raise UserError("--launcher submitit needs the `submitit` package, which is not "
                        "installed: pip install 'clbench[submitit]'") from None
    try:
        ex = submitit.AutoExecutor(folder=out_root / SUBMITIT_FOLDER, cluster=settings.cluster)
    except RuntimeError as exc:  # e.g. no Slurm on this machine
        raise UserError(f"--cluster {settings.cluster}: {exc}") from None
    ex.update_parameters(**settings.parameters())
    return ex


def submit(pending: Sequence[tuple[RunOptions, RunSpec]], out_root: Path,
           settings: ClusterSettings, console: Console) -> list[dict[str, Any]]:
    """Submit one job per run (a job array), record them in `out_root/sweep-jobs.json` and
    return the records (each with its submitit job under `job`, not recorded)."""
    ex = executor(out_root, settings)
    threads = settings.cpus_per_task
    if threads is None and settings.cluster != "slurm":  # this machine's cores, shared
        threads = threads_per_child(pending[0][0].device, len(pending))
    jobs = []
    with ex.batch():
        for options, _ in pending:
            jobs.append(ex.submit(RunJob(_anywhere(options).command_line(), threads)))
    records = [{"run": run.folder_name(), "seed": run.seed,
                "out_dir": str(Path(run.out_dir).resolve()),
                "job_id": job.job_id, "cluster": settings.cluster}
               for (_, run), job in zip(pending, jobs)]
    out_root.mkdir(parents=True, exist_ok=True)
    previous = _read_records(out_root)
    kept = [r for r in previous if r["out_dir"] not in {x["out_dir"] for x in records}]
    (out_root / JOBS_FILE).write_text(json.dumps(
        {"settings": asdict(settings), "jobs": kept + records}, indent=1) + "\n")
    console.print(f"submitted {len(jobs)} job(s) to {settings.cluster} "
                  f"({', '.join(str(j.job_id) for j in jobs)}); "
                  f"`clbench sweep --status --out {escape(str(out_root))}` shows them")
    return [{**r, "job": job} for r, job in zip(records, jobs)]


def _anywhere(options: RunOptions) -> RunOptions:
    """The options with their folder and suite file as absolute paths: a job may start in
    another working folder than the sweep."""
    suite = Path(options.suite)
    return options.model_copy(update={
        "out_dir": str(Path(str(options.out_dir)).resolve()),
        "suite": str(suite.resolve()) if suite.is_file() else options.suite})


def wait(records: Sequence[dict[str, Any]], out_root: Path, console: Console) -> list[str]:
    """Wait for the jobs, printing each run's change of state; one line per run that did not
    complete (its reason and where its log is)."""
    last: dict[str, str] = {}
    jobs = {r["out_dir"]: r["job"] for r in records}
    while True:
        states = status(out_root, list(jobs), jobs)
        for row in states:
            if last.get(row["out_dir"]) != row["state"]:
                console.print(f"{escape(row['run'])} seed {row['seed']}: {row['state']}"
                              + (f" ({escape(row['detail'])})" if row["detail"] else ""))
                last[row["out_dir"]] = row["state"]
        if all(row["state"] in ("done", "failed") for row in states):
            return [f"{r['run']} seed {r['seed']} ({r['detail']})" for r in states
                    if r["state"] == "failed"]
        time.sleep(POLL_SECONDS)


def status(out_root: Path, only: Sequence[str] | None = None,
           jobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each recorded run's state: `done` (its results complete), `failed` (its run failed,
    or its job ended without completing it), `running` or `queued` (the cluster's word), from
    its run folder first and its job second (`jobs`: the submitter's own job objects by run
    folder, which know a local job's process; otherwise asked of the cluster)."""
    records = _read_records(out_root)
    if not records:
        raise UserError(f"{out_root}: no {JOBS_FILE} (a sweep submitted with --launcher "
                        "submitit records its jobs there)")
    rows = []
    for r in records:
        if only is not None and r["out_dir"] not in set(only):
            continue
        job = (jobs or {}).get(r["out_dir"]) or _job(out_root, r)
        state, detail = _state(r, job)
        rows.append({**r, "state": state, "detail": detail})
    return rows


def _state(record: dict[str, Any], job: Any) -> tuple[str, str]:
    ended = job is not None and job.done()  # asked first: its results are then final
    recorded = _recorded_status(Path(record["out_dir"]))
    if recorded is not None and recorded[0] in ("complete", "collapsed"):
        return "done", ""
    if recorded is not None and recorded[0] == "failed":
        return "failed", recorded[1] or "the run failed"
    if ended:
        error = job.exception()
        reason = str(error).strip().splitlines()[-1] if error else "its job ended"
        return "failed", f"{reason}; job log {job.paths.stderr}"
    cluster_state = str(job.state).upper() if job is not None else "UNKNOWN"
    if cluster_state in ("PENDING", "REQUEUED", "CONFIGURING", "SUSPENDED", "UNKNOWN"):
        return "queued", "" if cluster_state == "PENDING" else cluster_state.lower()
    return "running", "" if cluster_state == "RUNNING" else cluster_state.lower()


def _recorded_status(run_dir: Path) -> tuple[str, str | None] | None:
    """The run's status and error as its results file has them (None: no readable file)."""
    results = run_dir / RESULTS_FILENAME
    if not results.is_file():
        return None
    try:
        recorded = read_results(results)
    except UserError:
        return None
    return recorded.status, recorded.error


def _job(out_root: Path, record: dict[str, Any]) -> Any:
    try:
        import submitit
    except ModuleNotFoundError:
        return None
    folder = out_root / SUBMITIT_FOLDER
    kinds = {"slurm": submitit.SlurmJob, "local": submitit.LocalJob,
             "debug": submitit.DebugJob}
    try:
        return kinds[record["cluster"]](folder=folder, job_id=str(record["job_id"]))
    except Exception:  # a job the cluster no longer knows: its run folder says the rest
        return None


def _read_records(out_root: Path) -> list[dict[str, Any]]:
    path = out_root / JOBS_FILE
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text())["jobs"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a sweep's record of its jobs") from None


def print_status(rows: Sequence[dict[str, Any]], console: Console) -> None:
    table = Table(title="sweep jobs")
    for column in ("run", "seed", "job", "state", "detail"):
        table.add_column(column)
    for r in rows:
        colour = {"done": "green", "failed": "red", "running": "cyan"}.get(r["state"], "yellow")
        table.add_row(escape(r["run"]), str(r["seed"]), str(r["job_id"]),
                      f"[{colour}]{r['state']}[/]", escape(r["detail"]))
    console.print(table)
    counts = {s: sum(r["state"] == s for r in rows) for s in ("queued", "running", "done",
                                                                "failed")}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
