"""The grid of a sweep: methods x seeds, each run in `<out_root>/<method>[+<addon>...]/s<seed>`.

This module owns the grid: enumerating and validating its runs, skipping complete ones, running
the others one at a time in this process (`jobs=1`) or up to N at a time as child processes
(:mod:`clbench.sweep.children`), and the closing comparison over seeds. One run itself is
:func:`clbench.run.recipe.execute`.

A run that fails does not stop the others; the sweep lists it (with the end of its log, for a
child) and exits non-zero after the comparison of what completed; so does a child stopped by a
signal from outside the sweep (its run is not complete either).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from clbench.errors import UserError
from clbench.report.comparison import (
    comparison,
    comparison_groups,
    cost_comparison,
    print_comparison,
)
from clbench.report.intransigence import add_intransigence
from clbench.report.runs import collect_results, print_summary
from clbench.results import RESULTS_FILENAME
from clbench.run.recipe import RunInterrupted, execute
from clbench.run.rundir import IDENTITY_FILE, check_run_dir, run_identity
from clbench.run.setup import check_lm_eval_probes
from clbench.spec.options import RunOptions, RunSettings
from clbench.spec.schema import RunSpec
from clbench.sweep.children import (
    Child,
    ChildLauncher,
    report_failures,
    run_as_children,
    threads_per_child,
)
from clbench.sweep.cluster import ClusterSettings, submit, wait


def sweep(suite_ref: str, methods: Sequence[str], seeds: Sequence[int], out_root: str | Path,
          settings: RunSettings | None = None, jobs: int = 1,
          console: Console | None = None, cluster: ClusterSettings | None = None
          ) -> dict[str, Any]:
    """Run methods x seeds, each with `settings` (overrides, add-ons, model, ...), into
    `out_root/<method>[+<addon>...]/s<seed>` (`settings.joint`: their joint references, into
    `out_root/<method>-joint/s<seed>`): complete runs are skipped, partial ones resumed; `jobs`
    > 1 runs up to that many at once as child processes; `cluster` submits each as a job
    through submitit instead and waits for them (:mod:`clbench.sweep.cluster`). Ends with the
    comparison table over seeds (returned as data) of the stage-by-stage runs of these methods
    and seeds, with their intransigence where their joint references are there too.

    Raises :class:`UserError` naming the runs that failed or were stopped from outside the
    sweep (after the comparison), :class:`RunInterrupted` on Ctrl-C or SIGTERM. Progress, each
    run's summary and the comparison go to `console` (the CLI's); without one nothing is shown.
    """
    from clbench.train.distributed import launched_world_size

    settings = settings or RunSettings()
    if launched_world_size() > 1:
        # a run that fails on one process would leave the others waiting in a collective
        raise UserError("clbench sweep cannot run under a multi-process launch; launch one "
                        "`clbench run` per method and seed instead")
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: expected at least 1")
    console = console or Console(quiet=True)  # the CLI passes its own
    out_root = Path(out_root)
    # The whole grid is validated before anything trains. Each pair once: two children of the
    # same pair would write into the same run directory.
    runs = [grid_run(RunOptions.of(settings, suite=suite_ref, method=m, seed=s), out_root)
            for m in dict.fromkeys(methods) for s in dict.fromkeys(seeds)]
    pending = []
    for options, run in runs:
        if is_complete(run):
            console.print(f"[dim]skip {escape(run.folder_name())} seed {run.seed}: "
                          "complete[/]")
        else:
            pending.append((options, run))
    if pending:  # the same probes in every run: an unknown one is refused once, before any run
        check_lm_eval_probes(pending[0][1])
    incomplete: list[Child] = []
    broken: list[str] = []
    if cluster is not None and pending:
        records = submit(pending, out_root, cluster, console)
        broken = wait(records, out_root, console)
    elif jobs == 1:
        broken = run_in_process([run for _, run in pending], console)
    elif pending:
        launch = ChildLauncher(out_root, threads=threads_per_child(settings.device,
                                                                  min(jobs, len(pending))))
        incomplete = run_as_children(pending, launch, jobs, console)
    # each run and its counterpart (the stage-by-stage run of a joint one, and the other way)
    names = {run.entry_name() for _, run in runs}
    dirs = [d for name in sorted(names) for s in dict.fromkeys(seeds)
            for d in (out_root / name / f"s{s}", out_root / f"{name}-joint" / f"s{s}")
            if (d / RESULTS_FILENAME).is_file()]
    found = collect_results(dirs)
    add_intransigence(found)
    groups = comparison_groups(found)
    data = comparison(groups)
    print_comparison(console, data, cost_comparison(groups))
    if incomplete:
        report_failures(incomplete, len(runs), console)
    if broken:
        raise UserError(f"{len(broken)} of {len(runs)} runs failed: {'; '.join(broken)}")
    return data


def grid_run(options: RunOptions, out_root: Path) -> tuple[RunOptions, RunSpec]:
    """One run of the grid, validated, in `out_root/<its folder name>/s<seed>`, with the
    options that ask for it (`--out` set, the suite as the file found)."""
    from clbench.plugins.runspec import build_run_spec

    run = build_run_spec(options)
    run.out_dir = str(out_root / run.folder_name() / f"s{run.seed}")
    return options.model_copy(update={"out_dir": run.out_dir, "suite": run.suite_file}), run


def is_complete(run: RunSpec) -> bool:
    """True when the run's directory holds this very run, complete. Refuses (RunDirError) a
    directory that holds another run, before anything of the grid trains."""
    previous = check_run_dir(Path(run.out_dir), run_identity(run), resume=True)
    return previous is not None and previous.status == "complete"


def run_in_process(runs: Sequence[RunSpec], console: Console) -> list[str]:
    """One run after another in this process; a run that breaks does not lose the rest.
    Returns one line per failed run (what went wrong, where its log is)."""
    broken = []
    for run in runs:
        resume = (Path(run.out_dir) / IDENTITY_FILE).is_file()
        name = run.folder_name()
        console.rule(f"{name} seed {run.seed}" + (" (resume)" if resume else ""))
        try:
            print_summary(console, execute(run, resume=resume, console=console))
        except RunInterrupted:  # Ctrl-C or SIGTERM: the sweep stops with the run
            raise
        except Exception as exc:  # one broken run must not lose the rest of the grid
            what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, UserError) else str(exc)
            console.print(f"[red]{escape(name)} seed {run.seed} failed: {escape(what)}[/]")
            log = Path(run.out_dir) / "run.log"  # absent when it failed before it started
            broken.append(f"{name} seed {run.seed} ({what}"
                          + (f"; log {log})" if log.is_file() else ")"))
    return broken


# ---------------------------------------------------------------------------------------------
# Runs as child processes
# ---------------------------------------------------------------------------------------------
