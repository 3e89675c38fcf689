"""The `clbench` command line: parse options, call the library, print with rich.

`app` holds the root group, error handling and shared options; each other module registers a
family of commands on it: `listing` (list, validate, schema, methods show, addons show),
`tasks` (tasks show, tasks grade), `running` (run, sweep, report), `signal`, `exporting`
(export-lm-eval, export-model), `leaderboard` (leaderboard build, leaderboard serve). A new
command is a decorated function in one of them. `python -m clbench.cli` is the same command
as `clbench`.
"""

from clbench.cli import (  # noqa: F401 - register their commands
    exporting,
    leaderboard,
    listing,
    running,
    signal,
    tasks,
)
from clbench.cli.app import cli, main

__all__ = ["cli", "main"]
