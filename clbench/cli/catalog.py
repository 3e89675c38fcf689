"""What is installed, as the CLI shows it: tables of methods, task sources and suites, the
documented fields of a method's config or a task's parameters, and items of a task source.

Rendering only; finding plugins is :mod:`clbench.plugins.registry`, finding suites
:mod:`clbench.spec.suites`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clbench.text import printable

if TYPE_CHECKING:
    from pydantic import BaseModel

    from clbench.plugins.registry import PluginInfo
    from clbench.spec.suites import SuiteInfo
    from clbench.tasks.base import Example, TaskSource


def listing_table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                 collapse_padding=True)


def suites_table(suites: Sequence[SuiteInfo]) -> Table:
    table = listing_table("suites")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("description", overflow="fold", min_width=24, ratio=2)
    table.add_column("path", overflow="fold")
    for suite in suites:
        table.add_row(suite.name, escape(suite.description), str(suite.path))
    return table


def plugins_table(what: str, plugins: Sequence[PluginInfo], width: int) -> Table:
    """Methods or task sources; tasks also show domain, origin and license."""
    details = ("domain", "origin", "license") if what == "tasks" else ()
    # On a narrow terminal the description goes under the name instead of in its own column,
    # so that the distribution column still fits.
    stacked = bool(details) and width < 120
    table = listing_table(what)
    table.add_column("name", no_wrap=not stacked, overflow="fold")
    if not stacked:
        table.add_column("description", overflow="fold", min_width=20, ratio=1)
    for col in details:
        table.add_column(col, no_wrap=True)
    table.add_column("distribution", overflow="fold", min_width=7)
    for info in plugins:
        description = escape(info.description)
        if info.load_error:
            description = f"[red]{description}[/]"
        name = f"[bold]{escape(info.name)}[/]"
        cells = [f"{name}\n{description}"] if stacked else [name, description]
        table.add_row(*cells, *(info.details.get(c, "") for c in details),
                      info.distribution or "?")
    return table


def fields_table(title: str, model: type[BaseModel]) -> Table:
    """Every field of a pydantic model (a method's `Config`, a task's `Params`): name, type,
    default and the field's description, which is the documentation of record."""
    from pydantic_core import PydanticUndefined

    table = listing_table(title)
    table.add_column("field [dim](type)[/]", overflow="fold", max_width=26)
    table.add_column("default", overflow="fold", max_width=14)
    table.add_column("description", overflow="fold", min_width=24, ratio=1)
    for name, info in model.model_fields.items():
        if info.default is not PydanticUndefined:
            default = json.dumps(info.default, default=str)
        elif info.default_factory is not None:
            default = json.dumps(info.default_factory(), default=str)  # type: ignore[call-arg]
        else:
            default = "(required)"
        kind = _type_name(info.annotation)
        table.add_row(f"[bold]{escape(name)}[/]\n[dim]{escape(kind)}[/]", escape(default),
                      escape(info.description or ""))
    return table


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def _shown(example: Example) -> Example:
    """An item as shown: its text without control characters (a hub dataset's items are files
    from others)."""
    import dataclasses

    return dataclasses.replace(example, id=printable(example.id),
                               messages=printable(example.messages),
                               reference=printable(example.reference),
                               answer=printable(example.answer))


def print_examples(console: Console, task: TaskSource, examples: Sequence[Example]) -> None:
    """Each item: its messages, the reference and answer, and how the reference grades."""
    for example in examples:
        grade = task.grade(example, example.reference)
        shown = _shown(example)
        console.rule(f"[bold]{escape(shown.id)}[/]")
        for message in shown.messages:
            console.print(f"[cyan]{escape(message['role'])}:[/] {escape(message['content'])}",
                          soft_wrap=True)
        console.print(f"[magenta]reference:[/] {escape(shown.reference)}", soft_wrap=True)
        console.print(f"[magenta]answer:[/] {escape(json.dumps(shown.answer, default=str))}",
                      soft_wrap=True)
        colour = "green" if grade.correct else "red"
        feedback = f" feedback: {escape(printable(grade.feedback))}" if grade.feedback else ""
        console.print(f"[{colour}]grade of the reference: reward {grade.reward:.3f}, "
                      f"correct {grade.correct}[/]{feedback}", soft_wrap=True)
