"""The columns of R and the evaluation of one row.

A column is a stream task's or a probe's evaluation items (or an lm-eval probe); a row is every
column scored with the model as it is after a stage. Every method is evaluated by this same code
path, with per-item records saved beside the results. Row 0 goes through the base-row cache,
which wraps this module's evaluation (:mod:`clbench.run.baserow`).

A row is saved column by column: each column's records, then its cell in
`items/row{t}/cells.json`, stamped with everything the evaluation depends on besides the model's
weights (:func:`clbench.run.baserow.evaluation_stamp`). A run stopped halfway through a row
evaluates only the columns not saved when it resumes, with the same model (the trained stage's
checkpoint, see :mod:`clbench.run.recipe`) under the same stamp (same items, decoding, device
kind and precision, library versions and code); the recipe removes a row's saved cells
whenever it trains that stage afresh.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clbench.atomic import atomic_write_text
from clbench.errors import UserError
from clbench.eval.column import CellResult, evaluate_column, run_generate_fn, summarise_cell
from clbench.eval.records import read_records, records_path, write_records
from clbench.plugins import registry
from clbench.results import Cell
from clbench.seeding import derive_seed
from clbench.spec.schema import RunSpec, TaskSpec
from clbench.train.cpu import release_free_memory

if TYPE_CHECKING:
    from clbench.run.context import RunContext
    from clbench.tasks.base import Example, TaskSource

log = logging.getLogger("clbench.run.rows")

#: Per row, the cells of the columns evaluated so far (see the module docstring).
CELLS_FILE = "cells.json"


class ColumnPlan:
    """How one column is evaluated: a clbench task's eval items, or an lm-eval probe."""

    def __init__(self, name: str, task: TaskSource | None = None,
                 examples: Sequence[Example] = (), probe: Any = None) -> None:
        self.name, self.task, self.examples, self.probe = name, task, list(examples), probe


def plan_columns(run: RunSpec) -> tuple[list[ColumnPlan], list[TaskSource]]:
    """Eval plans of every column (stream tasks, then probes) and the stage task sources."""
    suite = run.suite
    plans, stage_tasks = [], []
    split = suite.protocol.split
    for i, stage in enumerate(suite.stages):
        stage_tasks.append(registry.build_task(stage.task, where=f"stages[{i}].task.params"))
    trained: set[str] = set()
    if split == "validation":  # no column is scored on an item any stage trains on
        for task, stage in zip(stage_tasks, suite.stages):
            trained |= {e.id for e in task.examples("train", stage.task.seed,
                                                    stage.task.train_size)}
    for task, stage in zip(stage_tasks, suite.stages):
        size = stage.task.eval_size or suite.protocol.eval_size
        plans.append(ColumnPlan(stage.name, task,
                                column_items(task, stage.task, size, split, trained)))
    for i, probe in enumerate(suite.probes):
        if probe.task is not None:
            task = registry.build_task(probe.task, where=f"probes[{i}].task.params")
            size = probe.task.eval_size or suite.protocol.eval_size
            plans.append(ColumnPlan(probe.name, task, column_items(
                task, probe.task, size, split, trained, stage=False)))
        else:
            plans.append(ColumnPlan(probe.name, probe=probe.lm_eval))
    return plans, stage_tasks


def column_items(task: TaskSource, spec: TaskSpec, size: int,
                 split: Literal["eval", "validation"] = "eval",
                 trained: Collection[str] = frozenset(), stage: bool = True) -> list[Example]:
    """The `size` items that score a column: the task's evaluation items, or its validation
    items: training-split items never trained on and never evaluation items (train and eval
    splits are disjoint by construction). For validation, the ids in `trained` (every stage's
    training items) are left out and the draw starts after a `stage`'s own `train_size` items
    (a probe trains on none); a source that cannot give `size` such items is refused."""
    if split == "eval":
        return task.examples("eval", spec.seed, size)
    base = spec.train_size if stage else 0
    own = {e.id for e in task.examples("train", spec.seed, base)} if base else set()
    excluded = own | set(trained)
    wanted = base + size
    for _ in range(3):  # the draw grows by what the exclusions took, as a larger draw may
        kept = [e for e in task.examples("train", spec.seed, wanted) if e.id not in excluded]
        if len(kept) >= size:
            return kept[:size]
        wanted += size - len(kept)
    raise UserError(f"{task.name}: only {len(kept)} validation items (training-split items no "
                    f"stage trains on) for the {size} asked; lower eval_size or train_size")


def evaluate_row(ctx: RunContext, row: int) -> list[CellResult]:
    """Evaluate every column of `ctx.plans` with the model as it is now; save the items of each
    cell.

    Columns of this row saved under the same `ctx.stamp`
    (:func:`clbench.run.baserow.evaluation_stamp`) by an
    evaluation that stopped are kept, not evaluated again.

    With several processes each grades a contiguous share of a column's items; the records are
    gathered in item order and every process computes the same cell. lm-eval probes run on the
    main process (the others wait for its cell). Only the main process writes records;
    `ctx.on_saved` is called after each column is saved (:class:`clbench.results.KeptTime`).
    """
    dist = ctx.dist
    main = dist is None or dist.is_main
    saved = saved_cells(ctx.run_dir, row, ctx.plans, ctx.stamp) if main else None
    if dist is not None and dist.num_processes > 1:
        saved = dist.broadcast(saved)  # the main process's reading, on every process
    assert saved is not None
    if saved:
        log.info("row %d: columns %s were saved before a stop and are kept", row,
                 ", ".join(saved))
    summaries = {name: cell.summary() for name, cell in saved.items()}
    cells = []
    for plan in ctx.plans:
        if plan.name in saved:
            cells.append(saved[plan.name])
            continue
        cell = _task_cell(ctx, row, plan) if plan.task is not None else _probe_cell(ctx, plan)
        if main:
            write_records(records_path(ctx.run_dir, row, plan.name), cell.records)
            summaries[plan.name] = cell.summary()
            # NaN allowed: an lm-eval score may be one (results.json writes it as null)
            atomic_write_text(_cells_path(ctx.run_dir, row), json.dumps(
                {"stamp": ctx.stamp, "cells": summaries}, ensure_ascii=False))
            ctx.on_saved()
        log.info("row %d column %s: score %s over %d items", row, plan.name, cell.score, cell.n)
        cells.append(cell)
        release_free_memory()  # the column's KV caches and logits are freed: return their pages
    return cells


def _task_cell(ctx: RunContext, row: int, plan: ColumnPlan) -> CellResult:
    """A clbench task's column: its items decoded and graded (this process's share of them
    under several processes, the records then gathered in item order)."""
    run, dist = ctx.run, ctx.dist
    decoding, boot = run.suite.protocol.decoding, run.suite.protocol.bootstrap_samples
    sharded = dist is not None and dist.num_processes > 1
    examples, first, label = plan.examples, 0, f"row {row}: eval {plan.name}"
    if sharded:
        from clbench.train.distributed import eval_share

        share = eval_share(len(examples), dist.process_index, dist.num_processes)
        examples, first = examples[share.start:share.stop], share.start
        # the bar counts this process's items (only the main process shows it)
        label += f" (items {first + 1}-{first + len(examples)} of {len(plan.examples)})"
    # Seeded per column (and share): a column sampled after a resume that skipped the columns
    # before it draws what it would have drawn.
    generate, prompts = run_generate_fn(
        ctx.model, ctx.tokenizer, decoding, run.model,
        seed=derive_seed(run.seed, row, "eval", plan.name, first))
    cell = evaluate_column(plan.name, plan.task, examples, generate,  # type: ignore[arg-type]
                           batch_size=prompts,
                           bootstrap_samples=0 if sharded else boot,  # after the gather
                           progress=ctx.progress, description=label)
    if sharded:
        cell = summarise_cell(plan.name, dist.gather(cell.records), boot)  # type: ignore[union-attr]
    return cell


def _probe_cell(ctx: RunContext, plan: ColumnPlan) -> CellResult:
    """An lm-eval probe's column, run on the main process and told to the others."""
    from clbench.eval.lmeval import run_probe

    run, dist = ctx.run, ctx.dist
    cell = None
    if dist is None or dist.is_main:
        base = Path(run.suite_file).parent if run.suite_file else None
        # Seeded per column, not per run: every run and row sees the same few-shot examples,
        # so the base row is the same for every seed (clbench.run.baserow).
        cell = run_probe(plan.name, ctx.model, ctx.tokenizer, plan.probe, base_dir=base,
                         batch_size=run.suite.protocol.decoding.batch_size,
                         seed=derive_seed("lmeval", plan.name),
                         bootstrap_samples=run.suite.protocol.bootstrap_samples)
    if dist is not None:
        cell = dist.broadcast(cell)
    assert cell is not None
    return cell


def _cells_path(run_dir: Path, row: int) -> Path:
    return records_path(run_dir, row, CELLS_FILE).with_name(CELLS_FILE)


def saved_cells(run_dir: Path, row: int, plans: Sequence[ColumnPlan],
                stamp: str) -> dict[str, CellResult]:
    """The columns of `row` saved by an evaluation that stopped before the row was complete,
    by name: only those saved under `stamp`, whose records are intact and are the column's
    items. Anything else is evaluated again."""
    try:
        saved = json.loads(_cells_path(run_dir, row).read_text(encoding="utf-8"))
        summaries = saved["cells"] if saved["stamp"] == stamp else {}
    except (OSError, ValueError, TypeError, KeyError):
        return {}
    kept = {}
    for plan in plans:
        if not isinstance(summaries, dict) or plan.name not in summaries:
            continue
        try:
            records = read_records(records_path(run_dir, row, plan.name))
            cell = CellResult(**summaries[plan.name], records=records)
        except (OSError, ValueError, TypeError, KeyError):
            continue
        items = [e.id for e in plan.examples] if plan.task is not None else None
        if cell.column == plan.name and cell.n == len(records) and \
                (items is None or [r.id for r in records] == items):
            kept[plan.name] = cell
    return kept


def saved_column_names(run_dir: Path, row: int) -> list[str]:
    """The columns of `row` saved so far by an evaluation that stopped before the row was
    complete, as recorded (a resumed evaluation keeps those that pass `saved_cells`' checks)."""
    try:
        cells = json.loads(_cells_path(run_dir, row).read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, TypeError, KeyError):
        return []
    return [str(name) for name in cells] if isinstance(cells, dict) else []


def forget_saved_cells(run_dir: Path, row: int) -> None:
    """Drop the saved columns of `row`: they were scored with a model about to be retrained."""
    _cells_path(run_dir, row).unlink(missing_ok=True)


def to_cells(cells: Sequence[CellResult]) -> list[Cell | None]:
    out: list[Cell | None] = []
    for c in cells:
        if c.score is None:
            out.append(None)
            continue
        iv = c.interval or {}
        if not math.isfinite(c.score):  # e.g. an lm-eval aggregate of no document: undefined
            out.append(Cell(score=None, n=c.n))
            continue
        out.append(Cell(score=c.score, n=c.n, ci_low=iv.get("low"), ci_high=iv.get("high")))
    return out
