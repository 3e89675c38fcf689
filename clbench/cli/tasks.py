"""`clbench tasks show` and `clbench tasks grade`: what a task author looks at and debugs with.

Both take a registered task source (`math.arithmetic`) or a task file (`tasks/units.yaml`,
relative to the working folder), with `--set` parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from clbench.cli.app import ClbenchGroup, cli, parse_sets, stdout_console
from clbench.errors import UserError
from clbench.report.tables import print_uncut

#: A completion file larger than this is refused (a model's answer is kilobytes).
MAX_COMPLETION_BYTES = 4 * 1024 * 1024


@cli.group("tasks", cls=ClbenchGroup)
def tasks_group() -> None:
    """Inspect task sources and task files (`clbench list tasks` lists the sources).

    \b
    Example:
      clbench tasks show tool_use.generated --n 2
      clbench tasks show examples/tasks/units.yaml --n 2
      clbench tasks grade math.arithmetic --index 0 --completion-file answer.txt
    """


def _item_options(command: Any) -> Any:
    """The options that say which items of which task: seed, split, parameters."""
    for option in reversed([
        click.option("--seed", type=int, default=1234, show_default=True, help="Data seed."),
        click.option("--split", type=click.Choice(["train", "eval"]), default="eval",
                     show_default=True, help="Which split to draw from (every source has an "
                     "eval split; evaluation-only sources, such as BFCL and AIME, have no "
                     "train split)."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="A task parameter, e.g. --set digits=3 (repeatable).")]):
        command = option(command)
    return command


def _task(name: str, sets: tuple[str, ...]) -> tuple[Any, Any]:
    """(spec, task source) of a registered name or a task file, with `--set` parameters."""
    from clbench.plugins.registry import build_task
    from clbench.spec.schema import TaskSpec
    from clbench.spec.suites import apply_overrides, read_task_file_of

    params = apply_overrides({}, parse_sets(sets), example="digits=3")
    spec = TaskSpec(source=name, params=params)
    if spec.is_file:
        read_task_file_of(spec, Path.cwd())
    return spec, build_task(spec, where="params")


@tasks_group.command("show")
@click.argument("name")
@click.option("--n", "n", type=click.IntRange(min=1, max=1000), default=3, show_default=True,
              help="Number of items to show.")
@_item_options
def tasks_show_command(name: str, n: int, seed: int, split: str, sets: tuple[str, ...]) -> None:
    """Show a task: its parameters (what `params` of a suite's task may set), then items: the
    prompt, the reference and the reference's grade. NAME is a registered source or a task
    file.

    \b
    Example:
      clbench tasks show math.arithmetic --n 3 --seed 0 --split eval
      clbench tasks show math.arithmetic --set digits=3 --set 'operators=+*'
      clbench tasks show examples/tasks/units.yaml --n 2
    """
    from clbench.cli import catalog
    from clbench.plugins.registry import task_class

    spec, task = _task(name, sets)
    console = stdout_console()
    print_uncut(console, catalog.fields_table(f"{task.name} parameters", task_class(spec).Params))
    catalog.print_examples(console, task, task.examples(split, seed, n))


@tasks_group.command("grade")
@click.argument("source")
@click.option("--index", type=click.IntRange(min=0, max=99_999), required=True,
              help="Which item: its position among the items drawn (0 is the first `clbench "
              "tasks show` shows, with the same --seed, --split and --set).")
@click.option("--completion-file", "completion_file", required=True, metavar="FILE",
              type=click.Path(dir_okay=False, allow_dash=True),
              help="The completion to grade, as the model wrote it (`-`: standard input).")
@click.option("--json", "as_json", is_flag=True, help="Print the grade as one JSON object.")
@_item_options
def tasks_grade_command(source: str, index: int, completion_file: str, as_json: bool,
                        seed: int, split: str, sets: tuple[str, ...]) -> None:
    """Grade one completion against one item: whether it is correct, its reward and the
    feedback the grader gives (what SDPO's teacher reads).

    \b
    Example:
      clbench tasks grade math.arithmetic --index 0 --completion-file answer.txt
      echo '\\boxed{42}' | clbench tasks grade examples/tasks/units.yaml --index 3 \\
          --completion-file - --json
    """
    from clbench.text import printable

    completion = _read_completion(completion_file)
    _, task = _task(source, sets)
    items = task.examples(split, seed, index + 1)
    if index >= len(items):
        raise UserError(f"--index {index}: the {split} split of {task.name} has {len(items)} "
                        "items")
    example = items[index]
    grade = task.grade(example, completion)
    if as_json:
        click.echo(json.dumps({"id": example.id, "correct": grade.correct,
                               "reward": grade.reward, "feedback": grade.feedback,
                               "format_error": grade.format_error}, ensure_ascii=False))
        return
    console = stdout_console()
    colour = "green" if grade.correct else "red"
    console.print(f"item: {escape(printable(example.id))}", soft_wrap=True)
    console.print(f"[{colour}]correct: {str(grade.correct).lower()}[/]")
    console.print(f"reward: {grade.reward:.3f}")
    feedback = printable(grade.feedback) if grade.feedback else "(none)"
    console.print(f"feedback: {escape(feedback)}", soft_wrap=True)


def _read_completion(path: str) -> str:
    """The completion file's text (bounded; `-` is standard input)."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_COMPLETION_BYTES + 1)
        else:
            file = Path(path)
            if not file.is_file():
                raise UserError(f"{path}: no such file" if not file.exists() else
                                f"{path}: not a regular file")
            with file.open("rb") as f:
                raw = f.read(MAX_COMPLETION_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_COMPLETION_BYTES:
        raise UserError(f"{path}: larger than {MAX_COMPLETION_BYTES // (1024 * 1024)} MiB; a "
                        "completion is what a model wrote for one item")
    return raw.decode("utf-8", errors="replace")
