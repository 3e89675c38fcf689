"""Progress of a run: live bars on a terminal, plain timestamped lines everywhere else.

A run is often started where no one watches a terminal: a batch job whose output goes to a file,
`nohup`, CI, or a sweep child logging to `<out>/logs/`. Rich's live bars draw nothing there, so a
CPU run would print nothing for hours. :func:`run_progress` gives rich's `Progress` on a terminal
and :class:`LineProgress` otherwise; both take the same calls (`add_task`, `advance`,
`remove_task`), so the protocol and evaluation code do not care which one they hold.
Libraries' own bars (transformers loading a local model's weights) are kept off a run's
output with :func:`library_bars_off`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: Seconds between two lines about the same unfinished task.
LINE_INTERVAL_S = 60.0


def draws_live(console: Console) -> bool:
    """Whether live displays (bars, a sweep's table) are drawn: a terminal or a notebook."""
    return console.is_terminal or console.is_jupyter


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """transformers' (and the hub's) tqdm bars off within the block, as they were after it: a
    run's own progress lines are what its output shows. Only for work that is quick and local
    (a model loaded from a folder); a download from the hub keeps its bars."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def run_progress(console: Console, disable: bool = False) -> AnyProgress:
    """Bars with elapsed time and ETA where live displays are drawn; lines every minute (and
    when a task completes) when the console is a file or a pipe."""
    if draws_live(console) or disable:
        return Progress(TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console, transient=True,
                        disable=disable)
    return LineProgress(console)


def clock_time(seconds: float) -> str:
    """`H:MM:SS` (hours unbounded: `27:00:00`, not `1 day, 3:00:00`)."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    started: float
    last_line: float
    done_at_start: float = field(default=0.0)


class LineProgress:
    """`Progress`'s calls as plain lines: `14:02:51 stage 1 math: train 5/16, 0:03:12 elapsed,
    about 0:07:02 left` (the time of day first, so a log shows when), at most one per task
    every `interval` seconds, and one when it completes."""

    def __init__(self, console: Console, interval: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 time_of_day: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
        self.console, self.interval, self.clock = console, interval, clock
        self.time_of_day = time_of_day
        self.tasks: dict[int, _Task] = {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, total: float | None = 100.0, completed: float = 0,
                 **_: Any) -> int:
        now = self.clock()
        task_id = len(self.tasks)
        self.tasks[task_id] = _Task(description, total, completed, now, now, completed)
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        task = self.tasks[task_id]
        task.completed += advance
        now = self.clock()
        finished = task.total is not None and task.completed >= task.total
        if finished or now - task.last_line >= self.interval:
            task.last_line = now
            self.console.print(escape(f"{self.time_of_day()} {self.describe(task, now)}"),
                               highlight=False, soft_wrap=True)

    def remove_task(self, task_id: int) -> None:
        self.tasks.pop(task_id, None)

    @staticmethod
    def describe(task: _Task, now: float) -> str:
        """One line: what, how far, how long so far and, from the rate so far, how long left."""
        elapsed = now - task.started
        count = f"{task.completed:g}" + ("" if task.total is None else f"/{task.total:g}")
        line = f"{task.description} {count}, {clock_time(elapsed)} elapsed"
        progressed = task.completed - task.done_at_start
        if task.total is not None and task.completed >= task.total:
            return line + ", done"
        if task.total is not None and progressed > 0:
            left = elapsed / progressed * (task.total - task.completed)
            line += f", about {clock_time(left)} left"
        return line


#: What :func:`run_progress` returns.
AnyProgress = Progress | LineProgress
