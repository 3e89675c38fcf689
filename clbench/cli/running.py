"""`clbench run`, `sweep` and `report`: one run, a grid of runs, and the tables of runs on disk."""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from clbench.cli.app import cli, not_empty, run_settings, run_settings_options, stdout_console
from clbench.errors import UserError
from clbench.seeding import MAX_SEED

# ---------------------------------------------------------------------------------------------
# clbench run
# ---------------------------------------------------------------------------------------------

@cli.command("run")
@click.option("--suite", "suite_ref", required=True, metavar="NAME|FILE",
              help="A named suite (see `clbench list suites`) or a suite file.")
@click.option("--method", "method_name", required=True, metavar="NAME",
              help="A method plugin (see `clbench list methods`).")
@click.option("--seed", type=click.IntRange(-MAX_SEED, MAX_SEED), default=0, show_default=True,
              help="Run seed.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              callback=not_empty,
              help="Run directory  [default: runs/<suite>/<method>[+<addon>...]/s<seed>]")
@click.option("--resume", is_flag=True,
              help="Continue a stopped run where it stopped: from the last checkpoint of a "
                   "stage in progress, without evaluating a saved column again.")
@run_settings_options(
    "The joint reference run: train one stage on every stream task at once (their steps "
    "summed) instead of stage by stage; `clbench report` uses its scores for other runs' "
    "intransigence  [default out: runs/<suite>/<method>-joint/s<seed>]")
@click.option("--plan", "plan_only", is_flag=True, help="Print the validated plan and stop.")
@click.option("--estimate", is_flag=True,
              help="With --plan: also estimate the run's wall time and disk on this machine, "
                   "from a short calibration (one evaluation batch per column and two "
                   "training steps per stage, on a copy of the model; nothing is written).")
def run_command(suite_ref: str, method_name: str, seed: int, out_dir: str | None, resume: bool,
                plan_only: bool, estimate: bool, **settings: Any) -> None:
    """Benchmark a method on a suite: train stage by stage and fill the accuracy matrix.

    \b
    Example:
      clbench run --suite starter --method sdpo --seed 0
      clbench run --suite starter --method sdpo --seed 0 --set method.lr=2e-5 \\
          --set stages[0].budget.steps=4 --out runs/starter-lr2e-5/sdpo/s0
      clbench run --suite starter --method sdpo --addon ewc --set addon.ewc.strength=10
      clbench run --suite starter --method sdpo --seed 0 --joint
      clbench run --suite starter --method sdpo --plan --estimate
    """
    from clbench.plugins import registry
    from clbench.plugins.runspec import build_run_spec
    from clbench.report.runs import print_plan, print_summary
    from clbench.spec.options import RunOptions

    registry.allow_location(method_name)  # typed by the user: a location may be imported
    options = RunOptions.of(run_settings(settings), suite=suite_ref, method=method_name,
                            seed=seed, out_dir=out_dir)
    if estimate and not plan_only:
        raise UserError("--estimate goes with --plan: clbench run --plan --estimate ...")
    run = build_run_spec(options)
    console = stdout_console()
    print_plan(console, run)
    if estimate:
        _print_estimate(run, console)
    elif plan_only:
        from clbench.report.runs import print_resolution

        print_resolution(console, importlib.import_module("clbench.run.setup").resolution(run))
    if plan_only:
        return
    from clbench.sweep.children import stop_when_sweep_ends

    stop_when_sweep_ends()  # a sweep's child: it stops when the sweep is gone
    # Imported here so that listing, validating and planning stay quick (no torch import).
    recipe = importlib.import_module("clbench.run.recipe")
    from clbench.train.distributed import launched_as_main

    result = recipe.execute(run, resume=resume, console=console)
    if launched_as_main():
        try:
            print_summary(console, result)
        except KeyboardInterrupt as exc:  # the results are written: say so, not "interrupted"
            detail = f"the run had completed: clbench report {shlex.quote(run.out_dir)} prints it"
            raise recipe.RunInterrupted.after(exc, detail) from None


def _print_estimate(run: Any, console: Console) -> None:
    """Calibrate on this machine (with a status line saying what is being measured) and print
    the run's estimate."""
    import time

    from clbench.report.runs import print_estimate

    setup = importlib.import_module("clbench.run.setup")
    started = time.monotonic()
    with console.status("calibrating on this machine: loading the model") as status:
        estimate, resolved = setup.estimate(
            run, on_step=lambda what: status.update(f"calibrating on this machine: {what}"))
    print_estimate(console, estimate, resolved, time.monotonic() - started)


@cli.command("sweep")
@click.option("--suite", "suite_ref", default=None, metavar="NAME|FILE",
              help="A named suite or a suite file (required unless --status).")
@click.option("--methods", default=None, metavar="A,B,...",
              help="Comma-separated methods (required unless --status).")
@click.option("--seeds", default="0", show_default=True, metavar="0,1,...",
              help="Comma-separated run seeds.")
@click.option("--out", "out_root", type=click.Path(file_okay=False), default=None,
              callback=not_empty,
              help="Root folder; each run goes to <out>/<method>[+<addon>...]/s<seed>  "
                   "[default: runs/<suite>]")
@run_settings_options(
    "Run the methods' joint references (`clbench run --joint`) into "
    "<out>/<method>-joint/s<seed>; the comparison then gives the stage-by-stage runs beside "
    "them their intransigence.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N",
              help="Runs at once, each a `clbench run` process logging to <out>/logs/ (1: one "
                   "after another in this process). On the CPU each gets an equal share of the "
                   "cores unless OMP_NUM_THREADS is set.")
@click.option("--launcher", type=click.Choice(["local", "submitit"]), default="local",
              show_default=True, help="`local`: runs on this machine (see --jobs); "
              "`submitit`: each run a cluster job (a job array) through submitit, resumed "
              "where it stopped when requeued after a preemption or a timeout; the sweep "
              "waits for them and compares the runs. Needs clbench[submitit].")
@click.option("--cluster", type=click.Choice(["slurm", "local", "debug"]), default="slurm",
              show_default=True, help="submitit's cluster: `slurm`, or `local` (jobs as "
              "processes of this machine) and `debug` (in this process) to try a sweep out.")
@click.option("--partition", default=None, metavar="NAME", help="Slurm partition.")
@click.option("--account", default=None, metavar="NAME", help="Slurm account.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=1, show_default=True,
              help="GPUs per job (Slurm).")
@click.option("--cpus-per-task", type=click.IntRange(min=1), default=None,
              help="CPU cores per job (also each run's thread count).")
@click.option("--time", "time_minutes", type=click.IntRange(min=1), default=24 * 60,
              show_default=True, metavar="MINUTES",
              help="Time limit per job; a run that reaches it saves and is requeued.")
@click.option("--mem", "mem_gb", type=click.IntRange(min=1), default=None, metavar="GB",
              help="Memory per job (Slurm).")
@click.option("--array-parallelism", type=click.IntRange(min=1), default=8, show_default=True,
              help="Jobs of the array running at once (Slurm).")
@click.option("--status", "show_status", is_flag=True,
              help="Show where each run of a submitit sweep under --out is (queued, running, "
                   "done, failed) and exit.")
def sweep_command(suite_ref: str | None, methods: str | None, seeds: str, out_root: str | None,
                  jobs: int, launcher: str, cluster: str, partition: str | None,
                  account: str | None, gpus_per_node: int, cpus_per_task: int | None,
                  time_minutes: int, mem_gb: int | None, array_parallelism: int,
                  show_status: bool, **settings: Any) -> None:
    """Run a grid of methods x seeds; complete runs are skipped, partial ones resumed.

    Every run gets the same --set overrides and --addon add-ons. Ends with a comparison table:
    mean ± std over seeds per method (n = seeds). A run that fails does not stop the others;
    the sweep then exits with status 2 naming it and its log once the rest are done. With
    --jobs N, up to N runs go side by side (a small model leaves most of a GPU idle), with a
    live table of their stages.

    \b
    Example:
      clbench sweep --suite starter --methods sft,grpo,sdpo --seeds 0,1,2 --out runs/starter
      clbench sweep --suite starter --methods sft,sdpo --seeds 0,1 --addon replay
      clbench sweep --suite starter --methods sft,grpo,sdpo --seeds 0,1 --device cuda --jobs 6
      clbench sweep --suite starter --methods sft,grpo,sdpo --seeds 0,1 --joint
      clbench sweep --suite paper --methods grpo,sdpo --seeds 0,1,2 --out runs/paper \
          --launcher submitit --partition gpu --gpus-per-node 1 --time 2880
      clbench sweep --status --out runs/paper
    """
    from clbench.plugins import registry
    from clbench.spec.suites import load_suite, resolve_suite
    from clbench.sweep import cluster as jobs_on_cluster
    from clbench.sweep import grid as sweep

    if show_status:
        if out_root is None:
            raise click.UsageError("--status needs --out, the sweep's root folder")
        jobs_on_cluster.print_status(jobs_on_cluster.status(Path(out_root)), stdout_console())
        return
    if suite_ref is None or methods is None:
        raise click.UsageError("--suite and --methods are required (unless --status)")
    on_cluster = None
    if launcher == "submitit":
        if jobs != 1:
            raise click.UsageError("--jobs is for --launcher local; on a cluster "
                                   "--array-parallelism sets how many jobs run at once")
        on_cluster = jobs_on_cluster.ClusterSettings(
            cluster=cluster, partition=partition, account=account, gpus_per_node=gpus_per_node,
            cpus_per_task=cpus_per_task, time_minutes=time_minutes, mem_gb=mem_gb,
            array_parallelism=array_parallelism)
    shared = run_settings(settings)
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    for name in method_list:  # typed by the user: a location may be imported
        registry.allow_location(name)
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds {seeds!r}: expected comma-separated integers, e.g. 0,1,2") \
            from None
    if not method_list or not seed_list:
        raise UserError("--methods and --seeds must each name at least one value")
    if any(abs(s) > MAX_SEED for s in seed_list):
        raise UserError(f"--seeds {seeds!r}: seeds must be between -{MAX_SEED} and {MAX_SEED}")
    if out_root is None:
        out_root = str(Path("runs") / load_suite(resolve_suite(suite_ref)).name)
    sweep.sweep(suite_ref, method_list, seed_list, out_root, shared, jobs=jobs,
                console=stdout_console(), cluster=on_cluster)


@cli.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead.")
@click.option("--markdown", "as_markdown", is_flag=True,
              help="Print Markdown tables instead (for a paper, a README or a pull request).")
@click.option("--compare", is_flag=True,
              help="Also each pair of methods' differences in ACC, BWT, forgetting and OOD "
                   "delta, with a 95% seed-and-item bootstrap interval and whether it leaves "
                   "out 0 (complete runs of one suite).")
def report_command(run_dirs: tuple[str, ...], as_json: bool, as_markdown: bool,
                   compare: bool) -> None:
    """Print the matrix, metrics and cost of runs, the comparison over seeds and the cost per run.

    A RUN_DIR holds a results.json, or is a folder searched for them (e.g. a sweep's root),
    or is a results file itself, whatever its name.

    \b
    Example:
      clbench report runs/starter
      clbench report runs/starter/sdpo/s0 --json
      clbench report runs/starter --markdown > results.md
      clbench report leaderboard/results/starter/*.json --compare
    """
    from clbench.report import runs as reporting

    if as_json and as_markdown:
        raise click.UsageError("--json and --markdown: choose one")
    console = stdout_console()
    if as_json or as_markdown:
        console = Console(file=sys.stdout, highlight=False, soft_wrap=True, color_system=None)
    reporting.report(list(run_dirs), as_json=as_json, as_markdown=as_markdown, console=console,
                     compare=compare)
