"""Progress where no terminal watches: plain lines with counts, elapsed time and time left."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress

from clbench.progress import LineProgress, clock_time, run_progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_are_rate_limited_and_say_elapsed_time_and_time_left() -> None:
    out, clock = io.StringIO(), FakeClock()
    progress = LineProgress(Console(file=out, width=200), interval=60, clock=clock,
                            time_of_day=lambda: "14:02:51")
    with progress:
        task = progress.add_task("stage 1 math: train", total=16)
        clock.now += 30
        progress.advance(task)  # 30 s after the start: too soon for a line
        clock.now += 30
        progress.advance(task)  # 60 s: 2 steps done at 30 s each, 14 left
        clock.now += 10
        progress.advance(task, 13)
        clock.now += 5
        progress.advance(task)  # the last one: always said
    assert out.getvalue().splitlines() == [
        "14:02:51 stage 1 math: train 2/16, 0:01:00 elapsed, about 0:07:00 left",
        "14:02:51 stage 1 math: train 16/16, 0:01:15 elapsed, done"]


def test_time_left_counts_only_what_this_session_did() -> None:
    """A resumed run's stage bar starts at the stages already done; they took no time here."""
    out, clock = io.StringIO(), FakeClock()
    progress = LineProgress(Console(file=out, width=200), interval=0, clock=clock,
                            time_of_day=lambda: "09:00:00")
    stages = progress.add_task("stages", total=3, completed=1)
    clock.now += 600
    progress.advance(stages)
    assert out.getvalue() == "09:00:00 stages 2/3, 0:10:00 elapsed, about 0:10:00 left\n"


def test_bars_on_a_terminal_and_lines_elsewhere() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(run_progress(terminal), Progress)
    assert isinstance(run_progress(Console(file=io.StringIO())), LineProgress)
    quiet = run_progress(Console(file=io.StringIO()), disable=True)  # not the main process
    assert isinstance(quiet, Progress) and quiet.disable


def test_clock_time_counts_hours_past_a_day() -> None:
    assert [clock_time(t) for t in (0, 59.6, 3600 + 61, 27 * 3600)] == [
        "0:00:00", "0:01:00", "1:01:01", "27:00:00"]
