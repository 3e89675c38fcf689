"""One stage of a run: training it with the method, and keeping it once it is trained.

While a stage trains, the method's progress is checkpointed every `checkpoint_minutes` of the
run (`checkpoints/stage{t}-step{k}/`, see :mod:`clbench.train.api` for the method's side), so a
run stopped in the middle of a long stage continues from its last such checkpoint.

A trained stage is kept before its row of R is evaluated: first the method's report
(`stages/stage{t}.json`), then the checkpoint (:func:`clbench.run.rundir.save_checkpoint`), then the
older checkpoints are pruned. So a checkpoint of a stage always has its report beside it, and a
run stopped while evaluating the stage resumes with :func:`trained_report` and the checkpoint
instead of training it again. The run itself is :mod:`clbench.run.recipe`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.atomic import atomic_write_json
from clbench.errors import RunFailed, UserError, stop_requests
from clbench.plugins.registry import PluginError
from clbench.run.rundir import (
    RunDirError,
    prune_checkpoints,
    save_checkpoint,
    save_progress_checkpoint,
)
from clbench.seeding import derive_seed, seed_everything

if TYPE_CHECKING:
    from clbench.run.context import RunContext
    from clbench.tasks.base import Example, TaskSource
    from clbench.train.addons import AddOn
    from clbench.train.api import Method, StageReport

log = logging.getLogger("clbench.run.stages")


def train_stage(ctx: RunContext, stage: int, method: Method, task: TaskSource,
                train_examples: list[Example], resume: dict[str, Any] | None = None
                ) -> StageReport:
    """Train stage `stage` (1-based) on `task`'s `train_examples` with the method, seeded from
    (run seed, stage); the method's report. Each step is logged and advances a progress bar.
    The method's progress is checkpointed every `run.checkpoint_minutes` (:class:`StepCheckpoints`);
    `resume` is such a checkpoint's progress when the stage continues after a stop (the student
    and the method's state already restored)."""
    from clbench.train.api import StageContext

    run, dist, progress = ctx.run, ctx.dist, ctx.progress
    assert dist is not None  # training always has the run's accelerator
    spec = run.training_stages()[stage - 1]
    stage_seed = derive_seed(run.seed, stage)
    seed_everything(stage_seed)
    steps_bar = progress.add_task(f"stage {stage} {spec.name}: train", total=spec.budget.steps,
                                  completed=0 if resume is None else int(resume["step"]) + 1)

    def log_step(record: dict[str, Any]) -> None:
        progress.advance(steps_bar)
        log.info("stage %d step %s", stage, json.dumps(record, default=str))
        if ctx.trackers is not None:
            ctx.trackers.log_step(stage, record)

    stage_ctx = StageContext(
        model=ctx.model, tokenizer=ctx.tokenizer, task=task, train_examples=train_examples,
        budget=spec.budget, stage_index=stage, stage_name=spec.name, seed=stage_seed,
        device=dist.device, work_dir=ctx.run_dir / "work" / f"stage{stage}", log_step=log_step,
        dist=dist, train_model=ctx.train_model, save_progress=StepCheckpoints(ctx, stage, method),
        resume=resume, generation=run.model.generation,
        nonfinite_loss=run.suite.protocol.nonfinite_loss, tasks=ctx.tasks, addons=ctx.addons)
    stage_ctx.work_dir.mkdir(parents=True, exist_ok=True)
    report = _run_method(ctx, method, stage_ctx)
    check_stage_report(run.method.name, stage, spec.budget.steps, report)
    if ctx.addons and not stage_ctx.addons_applied:
        raise PluginError(f"the method {run.method.name!r} trains a stage without clbench's "
                          "training loop (it overrides train_stage), so the add-ons "
                          f"{', '.join(repr(a.name) for a in ctx.addons)} cannot act on it; "
                          "run it without add-ons")
    if resume:  # restore_loop empties it: a method that ignored it retrained from mid-stage
        raise RuntimeError(f"method {run.method.name!r} saved progress in the middle of stage "
                           f"{stage} but did not continue from it (ctx.resume); its training "
                           "of this stage is not the uninterrupted one")
    progress.remove_task(steps_bar)
    return report


def _run_method(ctx: RunContext, method: Method, stage_ctx: Any) -> StageReport:
    """`method.train_stage(stage_ctx)`; a method that raises, exits the process or catches a
    stop request and goes on fails the run with one message naming it (a traceback in
    run.log), but the user's own mistakes are said as they are."""
    name, stage = ctx.run.method.name, stage_ctx.stage_index
    plugin = f"{type(method).__module__}.{type(method).__qualname__}"
    where = f"stage {stage} ({stage_ctx.stage_name}): the method {name!r} ({plugin})"
    stops = stop_requests()
    try:
        report = method.train_stage(stage_ctx)
    except (UserError, OSError):  # the user's to fix (a setting, a full disk): said as it is
        raise
    except SystemExit as exc:  # exit status 0 would say a partial run completed
        log.error("%s called sys.exit(%r)", where, exc.code)
        raise RunFailed(f"{where} called sys.exit({exc.code!r}): a method returns its report, "
                        "it does not end the process") from None
    except Exception as exc:
        log.exception("stage %d: the method %s (%s) raised", stage, name, plugin)
        raise RunFailed(f"{where} raised {type(exc).__name__}: {exc}. The traceback is in "
                        f"{ctx.run_dir / 'run.log'} (--debug prints it)") from exc
    if stop_requests() != stops:
        raise RunFailed(f"{where} caught a stop request (Ctrl-C, SIGTERM) and went on: the "
                        "stage is not kept; --resume trains it again")
    return report


class StepCheckpoints:
    """A stage's `StageContext.save_progress`: after an optimizer step, every
    `run.checkpoint_minutes`, the loop's progress is checkpointed with the student and the
    method's state (:func:`clbench.run.rundir.save_progress_checkpoint`); `ctx.on_saved` is
    called after each (:class:`clbench.results.KeptTime`). Every process calls it: the decision
    and the counters' sum are collectives."""

    def __init__(self, ctx: RunContext, stage: int, method: Method) -> None:
        self.ctx, self.stage, self.method = ctx, stage, method
        self.total = ctx.run.training_stages()[stage - 1].budget.steps
        self.last_saved = time.monotonic()

    def __call__(self, step: int, state: Callable[[], dict[str, Any]],
                 counts: dict[str, int] | None = None) -> None:
        ctx, dist = self.ctx, self.ctx.dist
        assert dist is not None
        # not after the last step: the stage's own checkpoint follows at once
        due = step + 1 < self.total and \
            time.monotonic() - self.last_saved >= ctx.run.checkpoint_minutes * 60
        if not dist.broadcast(due):  # one decision for every process
            return
        summed = dist.sum_counts(counts or {})  # a collective: every process
        # sharded, gathering the optimizer's shards is a collective too
        progress = state() if dist.is_main or dist.sharding is not None else None
        if dist.is_main:
            save_progress_checkpoint(ctx.run_dir, self.stage, step, ctx.model, self.method,
                                     {**progress, "counters": summed})  # type: ignore[dict-item]
            log.info("stage %d: checkpoint after step %d of %d", self.stage, step + 1,
                     self.total)
            ctx.on_saved()
        dist.wait()
        self.last_saved = time.monotonic()


def check_stage_report(method: str, stage: int, steps: int, report: Any) -> None:
    """A method that breaks its contract is named with its distribution (a user error, exit 2:
    the plugin needs fixing, not clbench): `train_stage` must return a `StageReport`, and a stage
    with steps to take must record them."""
    from clbench.plugins.registry import METHODS_GROUP, PluginError, plugin_origin
    from clbench.train.api import StageReport

    problem = None
    if not isinstance(report, StageReport):
        problem = (f"train_stage returned {type(report).__name__}, not a "
                   "clbench.train.api.StageReport")
    elif steps > 0 and not report.steps:
        problem = (f"stage {stage} has {steps} steps to take, but its StageReport records none "
                   "(a method records each optimizer step in StageReport.steps)")
    if problem is not None:
        origin = plugin_origin(METHODS_GROUP, method)
        raise PluginError(f"method {method!r} ({origin.target}, from distribution "
                          f"{origin.distribution or 'unknown'}): {problem}")


def keep_trained_stage(run_dir: Path, stage: int, report: StageReport, model: Any,
                       method: Method, addons: Sequence[AddOn] = ()) -> None:
    """Write the stage's report, then its checkpoint; prune the checkpoints before it."""
    atomic_write_json(report_path(run_dir, stage), {
        "steps": report.steps, "counters": report.counters, "wall_time": report.wall_time,
        "extra": report.extra}, indent=None)
    save_checkpoint(run_dir, stage, model, method, addons)
    prune_checkpoints(run_dir, stage)


def report_path(run_dir: Path, stage: int) -> Path:
    """`stages/stage{t}.json`: the method's full report of stage t (every step)."""
    return run_dir / "stages" / f"stage{stage}.json"


def trained_report(run_dir: Path, stage: int) -> StageReport:
    """The report of a stage trained before a stop, as the method returned it."""
    from clbench.train.api import StageReport

    path = report_path(run_dir, stage)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return StageReport(steps=saved["steps"], counters=saved["counters"],
                           wall_time=saved["wall_time"], extra=saved["extra"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{run_dir}: stage {stage} is checkpointed but its report {path} "
                          f"cannot be read ({exc}); the run cannot be resumed (the stage before "
                          "it is no longer checkpointed)") from None
