"""What happens around every stage of a run besides training and evaluation, as a list of
observers the recipe (:class:`clbench.run.recipe.RunRecipe`) calls in order:

- :class:`WeightDriftObserver`: the student's parameter drift, measured once a stage is trained
  (before it is kept, while the previous stage's checkpoint is on disk);
- :class:`RowDiagnostics`: once a row is evaluated, its rollouts, artifacts, response drift,
  transfer against distance and collapse (a collapsed run with `collapse.stop` ends there);
- :class:`ComputeAccount`: the run's wall time and peak memory, kept at every save point and
  added to the result with every row;
- :class:`ResultsWriter`: the result written (atomically, by the main process) after every row.

An observer acts on the main process unless it says otherwise; every process calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from clbench.results import (
    RESULTS_FILENAME,
    KeptTime,
    StageRecord,
    account_compute,
    peak_memory_bytes,
    write_results,
)
from clbench.run.diagnostics import (
    RowMeasures,
    WeightDrift,
    keep_base_weights,
    row_diagnostics,
)
from clbench.run.distance import PromptDistance

if TYPE_CHECKING:
    from clbench.run.recipe import RunRecipe
    from clbench.train.api import StageReport


class StageObserver:
    """Something done around every stage (see the module docstring); both points optional."""

    def after_training(self, recipe: RunRecipe, stage: int, report: StageReport) -> None:
        """Once stage `stage` is trained, before it is kept (a stage trained before a stop and
        taken from its checkpoint is not trained again: this is not called for it)."""

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        """Once row `row` of R is in `recipe.result`, with its stage's record and the method's
        report of the stage (both None for row 0, the base model's)."""


class WeightDriftObserver(StageObserver):
    """The student's 2-D weights after each stage against the base model's and the previous
    stage's (:class:`clbench.run.diagnostics.WeightDrift`): into the stage's report before it
    is kept (so a run resumed after that has it), then into its record's diagnostics."""

    def __init__(self, recipe: RunRecipe) -> None:
        self.drift = WeightDrift(recipe.run_dir, recipe.diagnostics.weight_drift)

    def after_training(self, recipe: RunRecipe, stage: int, report: StageReport) -> None:
        if recipe.dist.is_main:
            report.extra["weight_drift"] = self.drift.after_stage(stage, recipe.model)
            report.wall_time["weight_drift"] = self.drift.seconds

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        if record is not None and "weight_drift" in record.extra:
            record.diagnostics["weight_drift"] = record.extra.pop("weight_drift")


class RowDiagnostics(StageObserver):
    """Rollouts, artifacts, response drift, distance and collapse of each trained stage's row
    (:func:`clbench.run.diagnostics.row_diagnostics`), measured by the main process and the
    collapse told to every process; with `collapse.stop` a collapsed row ends the run."""

    def __init__(self, recipe: RunRecipe) -> None:
        spec = recipe.diagnostics.distance
        self.measures = RowMeasures(PromptDistance(recipe.items.plans, spec)
                                    if spec.enabled and recipe.dist.is_main else None)

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        if record is None or report is None:
            return
        result, dist = recipe.result, recipe.dist
        seconds: dict[str, float] = {}
        collapsed = dist.broadcast(row_diagnostics(
            recipe.context, row, result, record.diagnostics, seconds,
            recipe.items.train_sets[row - 1], self.measures, report.steps)
            if dist.is_main else None)
        record.wall_time.update(seconds)
        if collapsed and recipe.diagnostics.collapse.stop:
            result.status = "collapsed"
            result.error = f"collapsed after stage {row} ({record.name}): " + \
                "; ".join(collapsed)


class ComputeAccount(StageObserver):
    """The run's wall time summed over its sittings and its peak memory: kept at every save
    point (:class:`clbench.results.KeptTime`, so a resumed run counts the work a stop did not
    throw away) and added to the result with every row. Every process measures; the main one
    writes."""

    def __init__(self, recipe: RunRecipe) -> None:
        self.device = recipe.dist.device
        self.clock = KeptTime(recipe.run_dir, len(recipe.result.matrix),
                              write=recipe.dist.is_main)
        compute = recipe.result.compute
        if self.clock.carried_peak:  # a stopped sitting's peak, kept at its last save point
            compute.peak_memory_bytes = max(self.clock.carried_peak,
                                            compute.peak_memory_bytes or 0)
        self.recipe = recipe

    def saved(self) -> None:
        """A save point: a column, a step checkpoint, a trained stage."""
        self.clock.saved(len(self.recipe.result.matrix), peak_memory_bytes(self.device))

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        account_compute(recipe.result, self.clock.lap(), self.device)


class ResultsWriter(StageObserver):
    """`results.json` written atomically after every row (a partial result, then the complete
    one), by the main process; the others wait for it."""

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        write(recipe)


def write(recipe: RunRecipe) -> Path:
    """Write the recipe's result now (the main process), every process waiting for it."""
    path = recipe.run_dir / RESULTS_FILENAME
    if recipe.dist.is_main:
        write_results(path, recipe.result)
    recipe.dist.wait()
    return path


class TrackedRows(StageObserver):
    """Each row of R to the run's experiment trackers (`--report-to`)."""

    def after_row(self, recipe: RunRecipe, row: int, record: StageRecord | None,
                  report: StageReport | None) -> None:
        assert recipe.trackers is not None
        recipe.trackers.log_row(row, [c.name for c in recipe.result.columns],
                                [None if c is None else c.score
                                 for c in recipe.result.matrix[row]])


def stage_observers(recipe: RunRecipe) -> list[StageObserver]:
    """The observers of a run, in the order they act: what measures a row before what accounts
    for its cost and what writes it. Base weights are kept first where a diagnostic reads
    them."""
    spec = recipe.diagnostics
    observers: list[StageObserver] = []
    if recipe.dist.is_main and (spec.weight_drift.enabled or spec.response_drift.enabled) \
            and not any((recipe.run_dir / "checkpoints").glob("stage*")):
        keep_base_weights(recipe.run_dir, recipe.model)  # nothing trained: the base model
    if spec.weight_drift.enabled:
        observers.append(WeightDriftObserver(recipe))
    observers += [RowDiagnostics(recipe), recipe.compute, ResultsWriter()]
    if recipe.trackers is not None:
        observers.append(TrackedRows())
    return observers
