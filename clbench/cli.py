"""The `clbench` command line: parse options, call the library, print with rich.

Each command is one self-contained block below (a decorated function registered on the `cli`
group); a new command is added by appending a block, nothing else changes. Any
:class:`clbench.errors.UserError` raised by a command becomes one red line on stderr and exit
status 2; `clbench --debug ...` re-raises it to show the traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from clbench import __version__
from clbench.errors import UserError, stop_of, terminate_as_interrupt
from clbench.seeding import MAX_SEED

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


# Options shared by `run` and `sweep`.
device_option = click.option("--device", default="auto", show_default=True,
                             metavar="auto|cpu|cuda[:N]", help="Where to train and evaluate.")
no_base_cache_option = click.option(
    "--no-base-cache", "no_base_cache", is_flag=True,
    help="Evaluate row 0 (the base model) even when an identical row is cached from an "
         "earlier run.")


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty --out or --model would silently mean the current folder."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty")
    return value


def check_device(device: str) -> None:
    if not _DEVICE.match(device):
        raise UserError(f"--device {device!r}: expected auto, cpu, mps, cuda or cuda:N")


def stdout_console() -> Console:
    """A console on the current stdout (click's test runner swaps it, so build it per call).

    Under a multi-process launch (accelerate, torchrun) only the main process prints; the rank
    is read from the launcher's environment here so that the CLI does not import torch."""
    quiet = (os.environ.get("RANK") or "0") != "0"
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, quiet=quiet)


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False)


class ClbenchGroup(click.Group):
    """A click group that turns user errors into one message and exit status 2, Ctrl-C or
    SIGTERM into a clean stop (exit 130 or 143), and a file error into one message (exit 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminate_as_interrupt():
                return super().invoke(ctx)
        except UserError as exc:
            if ctx.find_root().params.get("debug"):
                raise
            stderr_console().print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            if ctx.find_root().params.get("debug"):
                raise
            word, code = stop_of(exc)
            stderr_console().print(f"[yellow]{word}[/]")
            ctx.exit(code)
        except OSError as exc:  # a path that cannot be read or written: a message, not a trace
            if ctx.find_root().params.get("debug"):
                raise
            stderr_console().print(f"[bold red]error:[/] {escape(describe_os_error(exc))} "
                                   "(--debug shows where)", soft_wrap=True)
            ctx.exit(1)


def describe_os_error(exc: OSError) -> str:
    """`PATH: what went wrong`, in words a user acts on."""
    what = exc.strerror or str(exc)
    if exc.filename is None:
        return what
    path = Path(exc.filename)
    if isinstance(exc, FileExistsError) and path.exists() and not path.is_dir():
        what = "is a file, so no folder can be made there"  # mkdir of a parent that is a file
    return f"{path}: {what}"


@click.group(cls=ClbenchGroup, context_settings=CONTEXT_SETTINGS)
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(__version__, "--version", prog_name="clbench")
def cli(debug: bool) -> None:
    """clbench: a declarative continual-learning benchmark for LLM post-training.

    \b
    Example:
      clbench list methods
      clbench run --suite starter --method sdpo --seed 0
    """


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="clbench")


def parse_sets(values: tuple[str, ...]) -> list[str]:
    """`--set` values as given (the library parses and validates them)."""
    return [v for v in values if v.strip()]


# ---------------------------------------------------------------------------------------------
# clbench list
# ---------------------------------------------------------------------------------------------

@cli.command("list")
@click.argument("what", type=click.Choice(["methods", "tasks", "suites"]))
def list_command(what: str) -> None:
    """List the installed methods, task sources or named suites.

    `clbench methods show NAME` and `clbench tasks show NAME` document one of them.

    \b
    Example:
      clbench list methods
    """
    from clbench import catalog

    console = stdout_console()
    if what == "suites":
        from clbench.suites import list_suites

        console.print(catalog.suites_table(list_suites()))
        return
    from clbench import registry

    group = registry.METHODS_GROUP if what == "methods" else registry.TASKS_GROUP
    console.print(catalog.plugins_table(what, registry.list_plugins(group), console.width))


# ---------------------------------------------------------------------------------------------
# clbench validate
# ---------------------------------------------------------------------------------------------

@cli.command("validate")
@click.argument("files", nargs=-1, required=True)
def validate_command(files: tuple[str, ...]) -> None:
    """Validate suite files (fields and the parameters of every task source).

    Prints OK or the problems for each file; exits 0 when all are valid, 2 otherwise.

    \b
    Example:
      clbench validate suites/*.yaml
    """
    from clbench.suites import load_suite, resolve_suite, validate_suite_plugins

    console, errors = stdout_console(), stderr_console()
    failed = 0
    for ref in files:
        try:
            path = resolve_suite(ref)
            suite = load_suite(path)
            validate_suite_plugins(suite, path)
        except UserError as exc:
            failed += 1
            errors.print(f"[bold red]FAIL[/] {escape(ref)}\n{escape(str(exc))}", soft_wrap=True)
            continue
        console.print(f"[green]OK[/]   {escape(str(path))} ({escape(suite.name)}: "
                      f"{len(suite.stages)} stages, {len(suite.probes)} probes)", soft_wrap=True)
    if failed:
        raise click.exceptions.Exit(2)


# ---------------------------------------------------------------------------------------------
# clbench schema
# ---------------------------------------------------------------------------------------------

@cli.command("schema")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the schema to this file instead of stdout.")
def schema_command(output: Path | None) -> None:
    """Print the JSON Schema of suite files (for editor completion and checks).

    \b
    Example:
      clbench schema --output suite.schema.json
    """
    from clbench.specs import SuiteSpec

    text = json.dumps(SuiteSpec.model_json_schema(), indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    from clbench.atomic import atomic_write_text

    atomic_write_text(output, text)
    stdout_console().print(f"wrote {escape(str(output))}")


# ---------------------------------------------------------------------------------------------
# clbench tasks show
# ---------------------------------------------------------------------------------------------

@cli.group("tasks", cls=ClbenchGroup)
def tasks_group() -> None:
    """Inspect task sources (`clbench list tasks` lists them).

    \b
    Example:
      clbench tasks show tool_use.generated --n 2
    """


@tasks_group.command("show")
@click.argument("name")
@click.option("--n", "n", type=click.IntRange(min=1), default=3, show_default=True,
              help="Number of items to show.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Data seed.")
@click.option("--split", type=click.Choice(["train", "eval"]), default="eval",
              show_default=True, help="Which split to draw from (every source has an eval "
              "split; evaluation-only sources, such as BFCL and AIME, have no train split).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A task parameter, e.g. --set digits=3 (repeatable).")
def tasks_show_command(name: str, n: int, seed: int, split: str, sets: tuple[str, ...]) -> None:
    """Show a task source: its parameters (what `params` of a suite's task may set), then
    items: the prompt, the reference and the reference's grade.

    \b
    Example:
      clbench tasks show math.arithmetic --n 3 --seed 0 --split eval
      clbench tasks show math.arithmetic --set digits=3 --set operators=*
    """
    from clbench import catalog
    from clbench.registry import build_task, load_task_class
    from clbench.specs import TaskSpec
    from clbench.suites import apply_overrides

    params = apply_overrides({}, parse_sets(sets), example="digits=3")
    task = build_task(TaskSpec(source=name, params=params), where="params")
    console = stdout_console()
    console.print(catalog.fields_table(f"{name} parameters", load_task_class(name).Params))
    catalog.print_examples(console, task, task.examples(split, seed, n))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# clbench methods show
# ---------------------------------------------------------------------------------------------

@cli.group("methods", cls=ClbenchGroup)
def methods_group() -> None:
    """Inspect methods (`clbench list methods` lists them).

    \b
    Example:
      clbench methods show sdpo
    """


@methods_group.command("show")
@click.argument("name")
def methods_show_command(name: str) -> None:
    """Show a method's config: every field, its type, default and meaning (what
    `--set method.FIELD=VALUE` may set).

    \b
    Example:
      clbench methods show sdpo
    """
    from clbench import catalog
    from clbench.registry import load_method_class

    cls = load_method_class(name)
    console = stdout_console()
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        console.print(escape(" ".join(doc.split())), soft_wrap=True)
    console.print(catalog.fields_table(f"{name} config", cls.Config))


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
              callback=_not_empty,
              help="Run directory  [default: runs/<suite>/<method>/s<seed>]")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override: method.X (method config), model.X (model) or any suite field, "
                   "e.g. --set stages[0].budget.steps=4 (repeatable).")
@click.option("--resume", is_flag=True, help="Continue a run from its last completed stage.")
@click.option("--model", "model_name", default=None, metavar="NAME", callback=_not_empty,
              help="Model to train instead of the suite's default (hub id, path, tiny-*).")
@device_option
@no_base_cache_option
@click.option("--plan", "plan_only", is_flag=True, help="Print the validated plan and stop.")
def run_command(suite_ref: str, method_name: str, seed: int, out_dir: str | None,
                sets: tuple[str, ...], resume: bool, model_name: str | None, device: str,
                no_base_cache: bool, plan_only: bool) -> None:
    """Benchmark a method on a suite: train stage by stage and fill the accuracy matrix.

    \b
    Example:
      clbench run --suite starter --method sdpo --seed 0
      clbench run --suite starter --method sdpo --seed 0 --set method.lr=2e-5 \\
          --set stages[0].budget.steps=4 --out runs/starter-lr2e-5/sdpo/s0
    """
    from clbench import registry
    from clbench.reporting import print_plan
    from clbench.suites import build_run_spec

    check_device(device)
    run = build_run_spec(suite_ref, method_name, seed=seed, out_dir=out_dir,
                         overrides=parse_sets(sets), model=model_name, device=device,
                         reuse_base_row=not no_base_cache)
    config = registry.validate_method_params(run.method.name, run.method.params, where="method")
    console = stdout_console()
    print_plan(console, run, config.model_dump(mode="json"))
    if plan_only:
        return
    # Imported here so that listing, validating and planning stay quick (no torch import).
    protocol = importlib.import_module("clbench.protocol")
    protocol.execute(run, resume=resume, console=console)


@cli.command("sweep")
@click.option("--suite", "suite_ref", required=True, metavar="NAME|FILE",
              help="A named suite or a suite file.")
@click.option("--methods", required=True, metavar="A,B,...", help="Comma-separated methods.")
@click.option("--seeds", default="0", show_default=True, metavar="0,1,...",
              help="Comma-separated run seeds.")
@click.option("--out", "out_root", type=click.Path(file_okay=False), default=None,
              callback=_not_empty,
              help="Root folder; each run goes to <out>/<method>/s<seed>  "
                   "[default: runs/<suite>]")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override applied to every run (repeatable), as in `clbench run`.")
@click.option("--model", "model_name", default=None, metavar="NAME", callback=_not_empty,
              help="Model to train instead of the suite's default.")
@device_option
@no_base_cache_option
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N",
              help="Runs at once, each a `clbench run` process logging to <out>/logs/ (1: one "
                   "after another in this process). On the CPU each gets an equal share of the "
                   "cores unless OMP_NUM_THREADS is set.")
def sweep_command(suite_ref: str, methods: str, seeds: str, out_root: str | None,
                  sets: tuple[str, ...], model_name: str | None, device: str,
                  no_base_cache: bool, jobs: int) -> None:
    """Run a grid of methods x seeds; complete runs are skipped, partial ones resumed.

    Ends with a comparison table: mean ± std over seeds per method (n = seeds). A run that
    fails does not stop the others; the sweep then exits with status 2 naming it and its log
    once the rest are done. With --jobs N, up to N runs go side by side (a small model leaves
    most of a GPU idle), with a live table of their stages.

    \b
    Example:
      clbench sweep --suite starter --methods sft,grpo,sdpo --seeds 0,1,2 --out runs/starter
      clbench sweep --suite starter --methods sft,grpo,sdpo --seeds 0,1 --device cuda --jobs 6
    """
    from clbench import sweep
    from clbench.suites import load_suite, resolve_suite

    check_device(device)
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
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
    sweep.sweep(suite_ref, method_list, seed_list, out_root, overrides=parse_sets(sets),
                model=model_name, device=device, reuse_base_row=not no_base_cache, jobs=jobs,
                console=stdout_console())


@cli.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead.")
def report_command(run_dirs: tuple[str, ...], as_json: bool) -> None:
    """Print the matrix and metrics of finished runs and the comparison over seeds.

    A RUN_DIR holds a results.json, or is a folder searched for them (e.g. a sweep's root).

    \b
    Example:
      clbench report runs/starter
      clbench report runs/starter/sdpo/s0 --json
    """
    from clbench import reporting

    console = stdout_console()
    if as_json:
        console = Console(file=sys.stdout, highlight=False, soft_wrap=True, color_system=None)
    reporting.report(list(run_dirs), as_json=as_json, console=console)


@cli.command("export-lm-eval")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--suite", "suite_ref", required=True, metavar="NAME|FILE",
              help="A named suite or a suite file.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Suite override (repeatable), e.g. --set protocol.eval_size=100.")
def export_lm_eval_command(out_dir: str, suite_ref: str, sets: tuple[str, ...]) -> None:
    """Export a suite's clbench tasks as lm-eval tasks (YAML + JSONL + grader hook).

    Score any Hugging Face model folder with lm-eval itself (clbench must be installed for the
    grader), e.g. a run's trained model written by `clbench export-model`:

    \b
    Example:
      clbench export-lm-eval lmeval_tasks --suite starter
      clbench export-model runs/starter/sdpo/s0 models/starter-sdpo-s0
      lm_eval --model hf --model_args pretrained=models/starter-sdpo-s0 \\
          --include_path lmeval_tasks --tasks clbench_starter
    """
    from clbench.lmeval_export import export_lm_eval
    from clbench.suites import load_suite, resolve_suite, validate_suite_plugins

    path = resolve_suite(suite_ref)
    suite = load_suite(path, parse_sets(sets))
    validate_suite_plugins(suite, path)
    written = export_lm_eval(suite, out_dir)
    console = stdout_console()
    for p in written:
        console.print(f"wrote {p}")
    console.print(f"{len(written)} lm-eval tasks (tag clbench_{suite.name.replace('-', '_')}) "
                  f"in {out_dir}")


@cli.command("export-model")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def export_model_command(run_dir: str, out_dir: str) -> None:
    """Write a run's trained model (after its last completed stage) as a Hugging Face model
    folder: config, safetensors weights, tokenizer. `from_pretrained` and lm-eval load it.

    \b
    Example:
      clbench export-model runs/starter/sdpo/s0 models/starter-sdpo-s0
    """
    from clbench.model_export import export_model

    out, stage = export_model(run_dir, out_dir)
    stdout_console().print(f"wrote the model after stage {stage} of {escape(run_dir)} to "
                           f"{escape(str(out))}", soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    main()
