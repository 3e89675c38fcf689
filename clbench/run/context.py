"""What every part of one run shares while it runs, passed as one object.

The run's recipe (:mod:`clbench.run.recipe`) builds a :class:`RunContext` once the run's folder
is claimed and its model loaded; training a stage (:mod:`clbench.run.stages`) and evaluating a
row (:mod:`clbench.run.rows`) take it instead of a dozen parameters each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from clbench.progress import AnyProgress
    from clbench.run.rows import ColumnPlan
    from clbench.run.trackers import RunTrackers
    from clbench.spec.schema import RunSpec
    from clbench.tasks.base import TaskSource
    from clbench.train.addons import AddOn
    from clbench.train.distributed import Distributed


def _nothing() -> None:
    return None


@dataclass
class RunContext:
    """One run in progress.

    `model` is the plain student (generation, evaluation, checkpoints); `train_model` the same
    weights prepared by `dist` for training. `stamp` is what an evaluation depends on besides
    the weights (:func:`clbench.run.baserow.evaluation_stamp`), `plans` every column of R. Only the
    main process of `dist` writes files; `on_saved` is called after each save point (a column,
    a step checkpoint, a trained stage), so the run's kept time counts the work saved
    (:class:`clbench.results.KeptTime`). `console` gets the few messages a user must see while
    the progress bars run (a row 0 taken from the cache)."""

    run: RunSpec
    run_dir: Path
    model: Any
    tokenizer: Any
    progress: AnyProgress
    plans: Sequence[ColumnPlan] = ()
    stamp: str = ""
    dist: Distributed | None = None
    train_model: Any = None
    console: Console | None = None
    on_saved: Callable[[], None] = field(default=_nothing)
    tasks: Mapping[str, TaskSource] = field(default_factory=dict)  # stream tasks by stage
    addons: Sequence[AddOn] = ()  # the run's add-ons, in the order they compose
    trackers: RunTrackers | None = None  # `--report-to`: what the run also logs to

    @property
    def is_main(self) -> bool:
        return self.dist is None or self.dist.is_main
