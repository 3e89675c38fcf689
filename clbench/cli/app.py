"""The root of the `clbench` command: the group every command hangs on, how errors and stops
become one message and an exit status, and what several commands share (options, consoles).

A :class:`clbench.errors.UserError` raised by a command becomes one red line on stderr and exit
status 2, a file error one line naming the path and exit 1, Ctrl-C or SIGTERM a clean stop (130
or 143); `clbench --debug ...` re-raises to show the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from clbench import __version__
from clbench.errors import UserError, hangup_as_termination, stop_of, terminate_as_interrupt

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# Options shared by `run` and `sweep`: what every run of a sweep has in common
# (:class:`clbench.spec.options.RunSettings`).
device_option = click.option("--device", default="auto", show_default=True,
                             metavar="auto|cpu|cuda[:N]", help="Where to train and evaluate.")
trust_remote_code_option = click.option(
    "--trust-remote-code", is_flag=True,
    help="Let a hub model's repository run its own Python code (transformers' "
         "trust_remote_code). Only this flag allows it, never a suite or an override; the run "
         "records it. Use it for repositories you trust.")
checkpoint_minutes_option = click.option(
    "--checkpoint-minutes", type=click.FloatRange(min=0), default=15.0, show_default=True,
    metavar="MINUTES",
    help="Minutes between checkpoints in the middle of a stage (0: after every step, or batch "
         "when a batch serves several steps): a stopped run continues from the last one "
         "instead of training the stage again. Each holds the student, the optimizer state and "
         "any teacher (4-6 model sizes on disk; the stage's last one is kept).")
no_base_cache_option = click.option(
    "--no-base-cache", "no_base_cache", is_flag=True,
    help="Evaluate row 0 (the base model) even when an identical row is cached from an "
         "earlier run.")
allow_task_code_option = click.option(
    "--allow-task-code", is_flag=True,
    help="Let the lm-eval task folders of the suite's probes run their Python (a `utils.py`, "
         "a `!function`). Only this flag allows it, never the suite.")
addon_option = click.option(
    "--addon", "addons", multiple=True, metavar="NAME",
    help="A continual-learning add-on on the method (see `clbench list addons`), after the "
         "suite's `addons:`; repeatable, composed in the order given. Its settings: --set "
         "addon.NAME.FIELD=VALUE.")


def run_settings_options(joint_help: str) -> Any:
    """The options of :class:`clbench.spec.options.RunSettings` on a command (`run`, `sweep`);
    the command turns them into the model with :func:`run_settings`."""
    options = [
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="Override: method.X (method config), addon.NAME.X (an add-on's), "
                          "model.X (model) or any suite field, e.g. --set "
                          "stages[0].budget.steps=4 (repeatable). VALUE is read as YAML: 4, "
                          "1e-5, true, [acc, bwt]."),
        addon_option,
        click.option("--model", "model_name", default=None, metavar="NAME", callback=not_empty,
                     help="Model to train instead of the suite's default (hub id, path, "
                          "tiny-*)."),
        device_option, no_base_cache_option, checkpoint_minutes_option,
        trust_remote_code_option, allow_task_code_option,
        click.option("--joint", is_flag=True, help=joint_help),
        click.option("--report-to", "report_to", multiple=True,
                     type=click.Choice(["tensorboard", "wandb", "mlflow"]),
                     help="Also log the run to an experiment tracker (repeatable): each step's "
                          "record, each row of R, the metrics and the config, with files under "
                          "the run folder's trackers/ (W&B offline unless configured; MLflow "
                          "there unless MLFLOW_TRACKING_URI is set). Default: none. Needs "
                          "clbench[tensorboard], [wandb] or [mlflow]."),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


RUN_SETTINGS_PARAMS = ("sets", "addons", "model_name", "device", "no_base_cache",
                       "checkpoint_minutes", "trust_remote_code", "allow_task_code", "joint",
                       "report_to")


def run_settings(params: dict[str, Any]) -> Any:
    """The :class:`~clbench.spec.options.RunSettings` of a command's options (removed from
    `params`), the device checked first."""
    from clbench.spec.options import RunSettings

    values = {name: params.pop(name) for name in RUN_SETTINGS_PARAMS}
    check_device(values["device"])
    return RunSettings(sets=parse_sets(values["sets"]), addons=list(values["addons"]),
                       model=values["model_name"], device=values["device"],
                       reuse_base_row=not values["no_base_cache"],
                       checkpoint_minutes=values["checkpoint_minutes"],
                       joint=values["joint"], trust_remote_code=values["trust_remote_code"],
                       allow_task_code=values["allow_task_code"],
                       report_to=list(dict.fromkeys(values["report_to"])))


def not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty --out or --model would silently mean the current folder."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty")
    return value


def check_device(device: str) -> None:
    """Refuse a malformed --device before a suite is read (the spec applies the same rule)."""
    import re

    from clbench.spec.schema import DEVICE_PATTERN

    if not re.match(DEVICE_PATTERN, device):
        raise UserError(f"--device {device!r}: expected auto, cpu, mps, cuda or cuda:N")


def stdout_console() -> Console:
    """A console on the current stdout (click's test runner swaps it, so build it per call).

    Under a multi-process launch (accelerate, torchrun) only the main process prints; the rank
    is read from the launcher's environment here so that the CLI does not import torch."""
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, quiet=not main_process())


def stderr_console(quiet: bool = False) -> Console:
    return Console(file=sys.stderr, highlight=False, quiet=quiet)


def main_process() -> bool:
    """False in the other processes of a multi-process launch (accelerate, torchrun)."""
    return (os.environ.get("RANK") or "0") == "0"


class ClbenchGroup(click.Group):
    """A click group that turns user errors into one message and exit status 2, Ctrl-C,
    SIGTERM or SIGHUP (the terminal closed, unless `nohup` ignores it) into a clean stop (exit
    130 or 143), and a file error into one message (exit 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminate_as_interrupt(), hangup_as_termination():
                return super().invoke(ctx)
        except UserError as exc:
            if ctx.find_root().params.get("debug"):
                raise
            stderr_console(quiet=not (exc.every_rank or main_process())).print(
                f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            if ctx.find_root().params.get("debug"):
                raise
            word, code = stop_of(exc)
            stderr_console(quiet=not main_process()).print(f"[yellow]{word}[/]")
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
