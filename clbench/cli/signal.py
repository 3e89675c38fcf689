"""`clbench signal`: whether a method's training signal is informative on a suite's model."""

from __future__ import annotations

import importlib
import json
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from clbench.cli.app import (
    addon_option,
    allow_task_code_option,
    check_device,
    cli,
    device_option,
    not_empty,
    parse_sets,
    stderr_console,
    stdout_console,
    trust_remote_code_option,
)
from clbench.seeding import MAX_SEED


@cli.command("signal")
@click.option("--suite", "suite_ref", required=True, metavar="NAME|FILE",
              help="A named suite (see `clbench list suites`) or a suite file.")
@click.option("--method", "method_name", required=True, metavar="NAME",
              help="A method plugin (see `clbench list methods`).")
@click.option("--stage", type=click.IntRange(min=1), default=1, show_default=True,
              help="The stage whose start is measured (1-based); the stages before it are "
                   "trained first, by the method, as in a run.")
@click.option("--batches", type=click.IntRange(2, 64), default=5, show_default=True,
              help="Independent batches of the method's training step.")
@click.option("--validation-items", type=click.IntRange(1, 1000), default=24,
              show_default=True, help="Validation items per task whose reference answers give "
              "the direction compared with (training-split items after the stage's own).")
@click.option("--seed", type=click.IntRange(-MAX_SEED, MAX_SEED), default=0, show_default=True,
              help="Run seed.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override, as for `clbench run`: method.X, addon.NAME.X, model.X or any "
                   "suite field (repeatable).")
@addon_option
@click.option("--model", "model_name", default=None, metavar="NAME", callback=not_empty,
              help="Model instead of the suite's default (hub id, path, tiny-*).")
@device_option
@trust_remote_code_option
@allow_task_code_option
@click.option("--json", "as_json", is_flag=True, help="Print the measurement as one JSON "
              "object.")
def signal_command(suite_ref: str, method_name: str, stage: int, batches: int,
                   validation_items: int, seed: int, sets: tuple[str, ...],
                   addons: tuple[str, ...], model_name: str | None, device: str,
                   trust_remote_code: bool, allow_task_code: bool, as_json: bool) -> None:
    """Measure whether a method's training signal points towards right answers, before a run.

    From the model at the start of a stage, the gradient of the method's own loss on
    independent batches (its rollouts, teacher and loss as in a run) is compared with the
    gradient of the log-likelihood of reference answers on validation items: `alignment`
    (cosine with the update, and `adam_alignment` with its first Adam update) on the stage's
    task, `forgetting_alignment` on each earlier task, and `consistency` (the cosine between
    batches: near 1 with alignment near 0 is a fixed direction unrelated to correctness).
    Means over batches with 95% bootstrap intervals. Minutes on the CPU default.

    \b
    Example:
      clbench signal --suite starter --method sdpo
      clbench signal --suite starter --method grpo --stage 2 --batches 8 --json
    """
    from clbench.plugins import registry
    from clbench.plugins.runspec import build_run_spec
    from clbench.spec.options import RunOptions

    check_device(device)
    registry.allow_location(method_name)
    run = build_run_spec(RunOptions(
        suite=suite_ref, method=method_name, seed=seed, sets=parse_sets(sets),
        addons=list(addons), model=model_name, device=device,
        trust_remote_code=trust_remote_code, allow_task_code=allow_task_code))
    signal = importlib.import_module("clbench.run.signal")
    errors = stderr_console()
    result = signal.measure_signal(
        run, stage=stage, batches=batches, validation_items=validation_items,
        on_step=lambda what: errors.print(f"[dim]{escape(what)}[/]") if not as_json else None)
    if as_json:
        click.echo(json.dumps(result.as_json()))
        return
    _print(result)


def _print(result: Any) -> None:
    console = stdout_console()
    table = Table(title=f"signal of {escape(result.method)} at the start of stage "
                  f"{escape(result.stage)} ({result.batches} batches, "
                  f"{result.validation_items} validation items per task)")
    for column in ("measure", "mean", "95% interval", "what it says"):
        table.add_column(column, justify="right" if column in ("mean",) else "left")

    def row(name: str, value: Any, meaning: str) -> None:
        table.add_row(name, f"{value.mean:+.3f}", f"[{value.low:+.3f}, {value.high:+.3f}]",
                      meaning)

    row("alignment", result.alignment,
        "cosine of the update with the way to the references (> 0: it learns)")
    row("adam_alignment", result.adam_alignment, "the same for the first Adam update")
    row("consistency", result.consistency,
        "cosine between batches (near 1 with alignment near 0: a fixed drift)")
    for name, value in result.forgetting_alignment.items():
        row(f"forgetting_alignment {escape(name)}", value,
            "the same on an earlier task (< 0: the step forgets it)")
    if result.token_attribution:
        meanings = {"disagree": "teacher and student differ on the likeliest token",
                    "answer": "the answer's tokens", "eos": "the closing EOS",
                    "rest": "every other token (style, working)"}
        for kind, value in result.token_attribution.items():
            row(f"divergence share: {escape(kind)}", value, meanings.get(kind, ""))
        for kind, value in result.gradient_share.items():
            row(f"gradient share: {escape(kind)}", value,
                "gradient norm of the loss on these tokens alone, over the whole one's")
        for kind, value in result.alignment_by_kind.items():
            row(f"alignment: {escape(kind)}", value,
                "alignment of the update these tokens alone make")
    console.print(table)
    if result.silent_batches:
        console.print(f"[yellow]{result.silent_batches} of {result.batches} batches had no "
                      "gradient (every rollout of a prompt rewarded alike, say): their cosines "
                      "are 0[/]", soft_wrap=True)
