"""`clbench list`, `validate`, `schema`, `tasks show`, `methods show` and `addons show`: what is
installed and what a suite or plugin accepts, without training anything."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape

from clbench.cli.app import (
    ClbenchGroup,
    allow_task_code_option,
    cli,
    stderr_console,
    stdout_console,
)
from clbench.errors import UserError
from clbench.report.tables import UNLIMITED_WIDTH, print_uncut

# ---------------------------------------------------------------------------------------------
# clbench list
# ---------------------------------------------------------------------------------------------

@cli.command("list")
@click.argument("what", type=click.Choice(["methods", "addons", "tasks", "suites"]))
def list_command(what: str) -> None:
    """List the installed methods, continual-learning add-ons, task sources or named suites.

    `clbench methods show NAME`, `clbench addons show NAME` and `clbench tasks show NAME`
    document one of them.

    \b
    Example:
      clbench list methods
      clbench list addons
    """
    from clbench.cli import catalog

    console = stdout_console()
    if what == "suites":
        from clbench.spec.suites import list_suites

        print_uncut(console, catalog.suites_table(list_suites()))
        return
    from clbench.plugins import registry

    group = {"methods": registry.METHODS_GROUP, "addons": registry.ADDONS_GROUP,
             "tasks": registry.TASKS_GROUP}[what]
    # into a pipe: one row per plugin, whatever width rich assumes there
    width = console.width if console.is_terminal else UNLIMITED_WIDTH
    print_uncut(console, catalog.plugins_table(what, registry.list_plugins(group), width))


# ---------------------------------------------------------------------------------------------
# clbench validate
# ---------------------------------------------------------------------------------------------

@cli.command("validate")
@click.argument("files", nargs=-1, required=True)
@allow_task_code_option
def validate_command(files: tuple[str, ...], allow_task_code: bool) -> None:
    """Validate suite files (fields and the parameters of every task source; lm-eval probe
    task names are checked when a run starts, before its model loads).

    Prints OK or the problems for each file; exits 0 when all are valid, 2 otherwise.

    \b
    Example:
      clbench validate suites/*.yaml
    """
    from clbench.plugins.runspec import validate_suite_plugins
    from clbench.spec.suites import load_suite, resolve_suite

    console, errors = stdout_console(), stderr_console()
    failed = 0
    for ref in files:
        try:
            path = resolve_suite(ref)
            suite = load_suite(path)
            validate_suite_plugins(suite, path, allow_task_code=allow_task_code)
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
@click.option("--task-file", "task_file", is_flag=True,
              help="The schema of task files (a task declared in YAML) instead of suites.")
def schema_command(output: Path | None, task_file: bool) -> None:
    """Print the JSON Schema of suite files, or of task files (for editor completion and
    checks).

    \b
    Example:
      clbench schema --output suite.schema.json
      clbench schema --task-file --output task.schema.json
    """
    from clbench.spec.schema import SuiteSpec
    from clbench.spec.taskfile import TaskFile

    model = TaskFile if task_file else SuiteSpec
    text = json.dumps(model.model_json_schema(), indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    from clbench.atomic import atomic_write_text

    atomic_write_text(output, text)
    stdout_console().print(f"wrote {escape(str(output))}")


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
    from clbench.plugins.registry import load_method_class

    _show_config(name, load_method_class(name))


# ---------------------------------------------------------------------------------------------
# clbench addons show
# ---------------------------------------------------------------------------------------------

@cli.group("addons", cls=ClbenchGroup)
def addons_group() -> None:
    """Inspect continual-learning add-ons (`clbench list addons` lists them), which any method
    takes with `clbench run --addon NAME`.

    \b
    Example:
      clbench addons show ewc
    """


@addons_group.command("show")
@click.argument("name")
def addons_show_command(name: str) -> None:
    """Show an add-on's config: every field, its type, default and meaning (what
    `--set addon.NAME.FIELD=VALUE` or a suite's `addons:` entry may set).

    \b
    Example:
      clbench addons show replay
    """
    from clbench.plugins.registry import load_addon_class

    _show_config(name, load_addon_class(name))


def _show_config(name: str, cls: type) -> None:
    """A plugin's docstring's first paragraph, then its config's fields."""
    from clbench.cli import catalog

    console = stdout_console()
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        console.print(escape(" ".join(doc.split())), soft_wrap=True)
    print_uncut(console, catalog.fields_table(f"{name} config", cls.Config))  # type: ignore[attr-defined]
