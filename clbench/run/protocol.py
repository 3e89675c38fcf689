"""The continual protocol: evaluate the base model, then train and evaluate stage by stage.

`execute(run)` fills the accuracy matrix R of one run (row 0 = base model, row t = after stage
t) and keeps the run directory resumable at every moment:

    run.json                  identity of the run (suite hash, method and config, model, seed)
    results.json              the partial, then complete, result (atomic writes)
    run.log                   log file
    items/row{t}/{col}.jsonl  per-item evaluation records behind every cell
    items/row{t}/cells.json   the cells of row t's columns evaluated so far
    stages/stage{t}.json      the method's full stage report (every step)
    checkpoints/stage{t}/     student weights, method state, RNG states of the last stage trained
    checkpoints/stage{t}-step{k}/  the same after k steps of the stage in progress, with the
                              method's progress (every `checkpoint_minutes`)

A stage is checkpointed as soon as it is trained, before its row is evaluated, and counts as done
once its row is in results.json. A run killed at any moment resumes from what is on disk: during
training, the stage continues from its last step checkpoint (or starts again, for a method that
saves no progress); during evaluation, the trained stage is loaded and only the columns not yet
saved are evaluated (:mod:`clbench.run.rows`). Every stage re-seeds all RNGs from (run seed, stage
index) and a step checkpoint holds the RNG states, so a resumed run draws exactly the numbers an
uninterrupted run draws and, on CPU, ends with a bit-identical R.

Launched as several processes (accelerate, torchrun), every process runs this loop on its share
of the work (:mod:`clbench.train.distributed`): training is data-parallel, each column's items are
split over the processes and their records gathered in item order, lm-eval probes run on the
main process. Only the main process writes files, logs and prints; a barrier follows each write.

The run directory's identity and checkpoints live in :mod:`clbench.run.rundir`, the training and
keeping of one stage in :mod:`clbench.run.stages`, the columns and the evaluation of a row in
:mod:`clbench.run.rows`, seeds in :mod:`clbench.seeding`. A grid of methods x
seeds is :mod:`clbench.sweep.grid`; tables live in :mod:`clbench.report.runs`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rich.console import Console

from clbench.atomic import atomic_write_json
from clbench.errors import RunFailed, UserError, stop_of
from clbench.plugins import registry
from clbench.progress import run_progress
from clbench.results import (
    RESULTS_FILENAME,
    KeptTime,
    RunResult,
    StageRecord,
    account_compute,
    git_revision,
    new_result,
    peak_memory_bytes,
    reset_peak_memory,
    write_results,
)
from clbench.run.baserow import base_row, evaluation_stamp
from clbench.run.context import RunContext
from clbench.run.diagnostics import WeightDrift, keep_base_weights, row_diagnostics
from clbench.run.distance import PromptDistance
from clbench.run.joint import MixedTasks, mixed_train_set
from clbench.run.rows import (
    ColumnPlan,
    evaluate_row,
    forget_saved_cells,
    plan_columns,
    to_cells,
)
from clbench.run.rundir import (
    IDENTITY_FILE,
    RunDirError,
    check_run_dir,
    first_missing_folder,
    has_checkpoint,
    load_checkpoint,
    load_progress_checkpoint,
    lock_run_dir,
    progress_checkpoint,
    prune_checkpoints,
    release_unused_run_dir,
    run_identity,
    what_is_saved,
)
from clbench.run.scores import metric_values
from clbench.run.stages import keep_trained_stage, train_stage, trained_report
from clbench.seeding import derive_seed, seed_everything
from clbench.spec.schema import RunSpec
from clbench.tasks.base import TaskSizeError
from clbench.train.api import STAGE_KEY
from clbench.train.cpu import release_free_memory

if TYPE_CHECKING:
    from clbench.run.estimate import RunEstimate
    from clbench.tasks.base import Example, TaskSource
    from clbench.train.addons import AddOn
    from clbench.train.api import Method
    from clbench.train.distributed import Distributed

log = logging.getLogger("clbench.run.protocol")


class RunInterrupted(UserError):
    """Ctrl-C or SIGTERM: what was complete is saved; the run can be resumed."""

    exit_code = 130  # 143 after SIGTERM (see `after`)
    every_rank = False  # every process stops and reads the same run folder

    @classmethod
    def after(cls, stop: KeyboardInterrupt, detail: str) -> RunInterrupted:
        """`interrupted; <detail>` (exit 130) or `terminated; <detail>` (exit 143)."""
        word, code = stop_of(stop)
        error = cls(f"{word}; {detail}")
        error.exit_code = code
        return error


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

def fill_metrics(result: RunResult, run: RunSpec) -> None:
    """Compute the protocol's metrics from R (with per-stage values and undefined-notes)."""
    result.metrics = metric_values(result, run.suite.protocol)
    for name, metric in result.metrics.items():
        if metric.value is None:
            log.info("metric %s undefined: %s", name, metric.note)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def _attach_log(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "run.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("clbench")
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    return handler


def execute(run: RunSpec, resume: bool = False, console: Console | None = None) -> RunResult:
    """Run (or resume) one suite x method x seed and return its result (printing it is the
    caller's: :func:`clbench.report.runs.print_summary`). Progress bars and the few messages a
    user must see go to `console` (the CLI's); without one nothing is shown.

    Raises :class:`clbench.run.rundir.RunDirError` for a directory of another run,
    :class:`RunInterrupted` on Ctrl-C (after saving what is complete). A method that raises
    leaves a `failed` result.
    """
    console = console or Console(quiet=True)
    run_dir = Path(run.out_dir)
    method = registry.build_method(run.method)
    addons = registry.build_addons(run.addons)
    identity = run_identity(run)
    dist = make_distributed(run)
    check_sharding_support(run, method, addons, dist)
    if not dist.is_main:
        console = Console(quiet=True)
    def already_complete(previous: RunResult | None) -> bool:
        if previous is None or previous.status != "complete":
            return False
        console.print(f"[green]{run_dir} is already complete[/]")
        return True

    # A complete run is only read (a results folder may be read-only); another run's folder is
    # refused before anything is written to it.
    previous = check_run_dir(run_dir, identity, resume)
    dist.wait()  # every process has looked at the directory before the main one writes to it
    if already_complete(previous):
        return previous  # type: ignore[return-value]
    lock = handler = None
    created = first_missing_folder(run_dir)  # what locking creates, removed if unused
    try:
        refusal = None
        if dist.is_main:
            try:
                lock = lock_run_dir(run_dir)
            except RunDirError as exc:
                refusal = str(exc)
            except OSError as exc:  # e.g. a read-only folder: said to every rank, none left waiting
                refusal = (f"cannot create or lock the run folder {run_dir} "
                           f"({exc.strerror or exc}); choose another --out")
        refusal = dist.broadcast(refusal)
        if refusal is not None:
            raise RunDirError(refusal)
        # Read (again) under the lock: a process that held it may have finished the run since.
        previous = check_run_dir(run_dir, identity, resume, locked_by_us=True)
        dist.wait()
        if already_complete(previous):
            return previous  # type: ignore[return-value]
        # Every mistake that can be found before anything is computed is found before the
        # folder is claimed: a corrected command may then use the same --out.
        check_lm_eval_probes(run)  # every process: it only reads task folders
        _start_peak_memory(dist.device)
        items = _draw_items(run, first_stage=len(previous.matrix) if previous else 1)
        model = _load_model(run, dist)
        if dist.is_main:
            atomic_write_json(run_dir / IDENTITY_FILE, identity)
            handler = _attach_log(run_dir)
        dist.wait()
        return _execute(run, run_dir, (method, addons), previous, console, dist, model, items)
    finally:
        if handler is not None:
            logging.getLogger("clbench").removeHandler(handler)
            handler.close()
        if lock is not None:
            if handler is None:  # stopped before it held anything: leave no trace
                release_unused_run_dir(run_dir, created)
            lock.close()


def _start_peak_memory(device: Any) -> None:
    """This run's peak memory, not an earlier run's in this process (an in-process sweep): what
    those runs left to the garbage collector and the C heap is given back first, so the peak
    starts from what the process really holds."""
    gc.collect()
    release_free_memory()
    if not reset_peak_memory(device):
        log.info("cannot reset the peak of resident memory here: the run records the process's "
                 "peak since it started")


def resolution(run: RunSpec) -> dict[str, Any]:
    """What the run's `auto` settings resolve to on this machine, without loading the model:
    its device, precision and (on the CPU) torch threads."""
    from clbench.models import resolve_device
    from clbench.train.cpu import run_threads
    from clbench.train.distributed import resolve_precision

    device = resolve_device(run.device)
    precision = resolve_precision(run.model.dtype, run.model.mixed_precision, device)
    out: dict[str, Any] = {"device": str(device), "precision": precision.label}
    if device.type == "cpu":
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        out["cpu_threads"] = run_threads(local) or torch.get_num_threads()
    return out


def estimate(run: RunSpec, on_step: Any = None) -> tuple[RunEstimate, dict[str, Any]]:
    """The run's estimate on this machine (:mod:`clbench.run.estimate`: a short calibration with
    its model, device, precision and method) and how its device resolved. Writes nothing."""
    from clbench.run.estimate import Calibration, estimate_run

    method = registry.build_method(run.method)
    dist = make_distributed(run)
    items = _draw_items(run)
    model, tokenizer = _load_model(run, dist)
    cal = Calibration(run, dist, model, tokenizer, method, on_step or (lambda what: None))
    resolved = {"device": str(dist.device), **dist.describe()}
    return estimate_run(cal, items.plans, items.stage_tasks, items.train_sets), resolved  # type: ignore[arg-type]


def check_lm_eval_probes(run: RunSpec) -> None:
    """Refuse an unknown lm-eval task now, before the model loads, rather than when row 0
    reaches the probe's column (half an hour into a CPU run)."""
    probes = [(i, p.lm_eval) for i, p in enumerate(run.suite.probes) if p.lm_eval is not None]
    if probes:
        from clbench.eval.lmeval import check_probe
        from clbench.eval.lmeval_tasks import LmEvalProbeError

        base = Path(run.suite_file).parent if run.suite_file else None
        for i, probe in probes:
            try:
                check_probe(probe, base)
            except LmEvalProbeError as exc:
                where = f"{run.suite_file}: " if run.suite_file else ""
                raise LmEvalProbeError(f"{where}probes[{i}].lm_eval: {exc}") from None


class _Items(NamedTuple):
    plans: list[ColumnPlan]  # every column's eval items (or lm-eval probe)
    stage_tasks: list[TaskSource]  # what each of `run.training_stages()` trains on
    train_sets: list[list[Example] | None]  # each one's training items (None: stage done)
    tasks: dict[str, TaskSource]  # every stream stage's task by name (replayed items' graders)


def _draw_items(run: RunSpec, first_stage: int = 1) -> _Items:
    """Every item the run will still use, drawn before the model loads: a hub source that
    cannot give its training set (unreachable, too small, evaluation-only) is refused now, not
    after row 0. Items depend only on (params, split, seed, size), so drawing them early
    changes nothing; stages before `first_stage` are done and need no training items."""
    plans, stage_tasks = plan_columns(run)
    train_sets: list[list[Example] | None] = []
    for i, (task, spec) in enumerate(zip(stage_tasks, run.suite.stages)):
        if i + 1 < first_stage and not run.joint:
            train_sets.append(None)
            continue
        try:
            drawn = task.examples("train", spec.task.seed, spec.task.train_size)
        except TaskSizeError as exc:
            raise TaskSizeError(f"stage {spec.name!r} (stages[{i}].task.train_size="
                                f"{spec.task.train_size}): {exc}") from None
        except UserError as exc:
            raise UserError(f"stage {spec.name!r} (stages[{i}].task): {exc}") from None
        # each item knows its stage, so that replayed in a later one it is graded by its task
        train_sets.append([dataclasses.replace(e, metadata={**e.metadata, STAGE_KEY: spec.name})
                           for e in drawn])
    tasks = {spec.name: task for spec, task in zip(run.suite.stages, stage_tasks)}
    if run.joint:  # one stage over every stage's items
        seeds = [s.task.seed for s in run.suite.stages]
        mixed = mixed_train_set(train_sets, seeds)  # type: ignore[arg-type]
        caps = [s.budget.max_new_tokens for s in run.suite.stages]
        return _Items(plans, [MixedTasks(stage_tasks, caps)],
                      [mixed if first_stage <= 1 else None], {})
    return _Items(plans, stage_tasks, train_sets, tasks)


def _load_model(run: RunSpec, dist: Distributed) -> tuple[Any, Any]:
    """(model, tokenizer) on the run's device, initialised from the run seed (tiny models)."""
    seed_everything(derive_seed(run.seed, "init"))
    return dist.load_model(run.model, seed=run.seed)


def check_sharding_support(run: RunSpec, method: Method, addons: Sequence[AddOn],
                           dist: Distributed) -> None:
    """Refuse a sharded launch (FSDP2) of a method or add-on that has not declared it trains
    through `train_model` alone (:attr:`clbench.train.api.Method.supports_sharding`): its
    gradients would reach the plain copy of the student, which nothing trains."""
    if dist.sharding is None:
        return
    named = [(f"the method {run.method.name!r}", method)]
    named += [(f"the add-on {spec.name!r}", addon) for spec, addon in zip(run.addons, addons)]
    for what, plugin in named:
        # declared by the plugin's own class: a subclass may train differently from its parent
        if not vars(type(plugin)).get("supports_sharding", False):
            raise UserError(f"{what} does not support sharded training ({dist.sharding}, from "
                            "the accelerate config): launch it without FSDP (data parallel, "
                            "or one process), or see docs/plugins.md for what a plugin must "
                            "do to declare `supports_sharding`")


def warn_if_another_checkout(name: str, origin: registry.Origin) -> None:
    """Warn when a method that ships with clbench is loaded from another checkout than
    clbench itself: a PYTHONPATH naming one checkout's `clbench` folder still imports the
    methods from the installed one (their package is `methods/`), so a run would mix two
    versions of the code while recording one commit."""
    own = git_revision()
    if origin.distribution == "clbench" and origin.source_revision and own \
            and origin.source_revision != own:
        log.warning("the method %r ships with clbench but its code is from a checkout at %s, "
                    "clbench's from one at %s: results.json records both; to run one version, "
                    "install the checkout you mean (pip install -e .) instead of pointing "
                    "PYTHONPATH at it", name, origin.source_revision, own)


def make_distributed(run: RunSpec) -> Distributed:
    """The run's accelerator; refuses budgets that cannot be split over its processes."""
    from clbench.train.distributed import Distributed
    from clbench.train.optim import rank_share

    dist = Distributed.create(run.device, run.model.dtype, run.model.mixed_precision)
    dist.take_cpu_share()
    for spec in run.training_stages():  # before anything trains, not when the stage comes
        rank_share(range(spec.budget.prompts_per_step), 0, dist.num_processes, spec.name)
    return dist


def _execute(run: RunSpec, run_dir: Path, trainee: tuple[Method, list[AddOn]],
             previous: RunResult | None, console: Console, dist: Distributed,
             loaded: tuple[Any, Any], items: _Items) -> RunResult:
    device, main = dist.device, dist.is_main
    method, addons = trainee
    model, tokenizer = loaded
    plans = items.plans
    origin = registry.plugin_origin(registry.METHODS_GROUP, run.method.name)
    if main:
        warn_if_another_checkout(run.method.name, origin)
    sources = [s.task.source for s in run.suite.stages] + [p.task.source for p in run.suite.probes
                                                           if p.task is not None]
    result = previous or new_result(
        run, origin, {s: registry.load_task_class(s).version for s in sources},
        [registry.plugin_origin(registry.ADDONS_GROUP, a.name) for a in run.addons])
    # every setting as this session runs it (fields added since the run began included: the
    # run directory's check made sure they do what the run did)
    result.method.config = dict(run.method.params)
    result.status, result.error = "partial", None  # a failed run that is resumed is partial again
    clock = KeptTime(run_dir, len(result.matrix), write=main)
    if clock.carried_peak:  # a stopped sitting's peak, kept at its last save point
        result.compute.peak_memory_bytes = max(clock.carried_peak,
                                               result.compute.peak_memory_bytes or 0)

    def saved() -> None:
        clock.saved(len(result.matrix), peak_memory_bytes(device))
    done = max(0, len(result.matrix) - 1)
    diagnostics = run.suite.protocol.diagnostics
    drift = WeightDrift(run_dir, diagnostics.weight_drift) \
        if diagnostics.weight_drift.enabled and main else None
    distance = PromptDistance(plans, diagnostics.distance) \
        if diagnostics.distance.enabled and main else None
    if main and (drift is not None or diagnostics.response_drift.enabled) and \
            not any((run_dir / "checkpoints").glob("stage*")):
        keep_base_weights(run_dir, model)  # nothing trained yet: the model is the base model
    trained, resume = _restore(run, run_dir, result, model, (method, addons), console)
    # once per run (DDP keeps its buffers), on the weights the run continues from: a sharded
    # student is a copy of them
    train_model = dist.prepare_student(model)
    result.model.resolved = {"dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                             "parameters": sum(p.numel() for p in model.parameters()),
                             "device": str(device), **dist.describe()}
    stamp = evaluation_stamp(run, plans, result.model.resolved)
    stages = run.training_stages()
    stage = done
    try:
        with run_progress(console, disable=not main) as progress, dist.autocast():
            ctx = RunContext(run=run, run_dir=run_dir, model=model, tokenizer=tokenizer,
                             progress=progress, plans=plans, stamp=stamp, dist=dist,
                             train_model=train_model, console=console, on_saved=saved,
                             tasks=items.tasks, addons=addons)
            if not result.matrix:
                seed_everything(derive_seed(run.seed, 0))
                result.matrix.append(base_row(ctx, result))
                result.row_labels.append("base")
                account_compute(result, clock.lap(), device)  # a partial run says what it cost
                if main:
                    write_results(run_dir / RESULTS_FILENAME, result)
                dist.wait()
            stages_bar = progress.add_task("stages", total=len(stages), completed=done)
            for stage in range(done + 1, len(stages) + 1):
                spec = stages[stage - 1]
                if stage == trained:
                    report = trained_report(run_dir, stage)
                    if main:  # a stop between saving and pruning may have left some behind
                        prune_checkpoints(run_dir, stage)
                else:
                    if main:  # scored with the model about to be retrained
                        forget_saved_cells(run_dir, stage)
                    report = train_stage(ctx, stage, method, items.stage_tasks[stage - 1],
                                         items.train_sets[stage - 1],  # type: ignore[arg-type]
                                         resume=resume)
                    resume = None  # taken: its optimizer state is not kept for later stages
                    if drift is not None:  # before keeping it: the previous stage's is on disk
                        report.extra["weight_drift"] = drift.after_stage(stage, model)
                        report.wall_time["weight_drift"] = drift.seconds
                    if main:
                        keep_trained_stage(run_dir, stage, report, model, method, addons)
                        saved()
                    dist.wait()
                seed_everything(derive_seed(run.seed, stage, "eval"))
                cells = evaluate_row(ctx, stage)
                extra = json.loads(json.dumps(report.extra, default=str))
                found = {"weight_drift": extra.pop("weight_drift")} \
                    if "weight_drift" in extra else {}
                result.matrix.append(to_cells(cells))
                result.row_labels.append(f"after {spec.name}")
                seconds: dict[str, float] = {}
                collapsed = dist.broadcast(row_diagnostics(
                    ctx, stage, result, found, seconds, items.train_sets[stage - 1], distance,
                    report.steps) if main else None)
                result.stages.append(StageRecord(
                    index=stage, name=spec.name, summary=report.summary(),
                    counters=report.counters, wall_time={**report.wall_time, **seconds},
                    extra=extra, diagnostics=found))
                if collapsed and diagnostics.collapse.stop:
                    result.status = "collapsed"
                    result.error = f"collapsed after stage {stage} ({spec.name}): " + \
                        "; ".join(collapsed)
                account_compute(result, clock.lap(), device)
                if main:
                    write_results(run_dir / RESULTS_FILENAME, result)
                dist.wait()
                release_free_memory()  # before the next stage allocates its optimizer state
                progress.advance(stages_bar)
                log.info("stage %d (%s) done", stage, spec.name)
                if result.status == "collapsed":
                    log.warning("%s; the remaining stages are not trained (collapse.stop)",
                                result.error)
                    return result
    except KeyboardInterrupt as exc:
        log.warning("%s during %s", stop_of(exc)[0], f"stage {stage}" if stage else "row 0")
        kept = what_is_saved(run_dir, len(result.matrix), len(result.columns))
        raise RunInterrupted.after(exc, f"{kept}. Continue with the same command plus --resume"
                                   ) from None
    except Exception as exc:
        result.status = "failed"
        result.error = str(exc) if isinstance(exc, RunFailed) else \
            f"stage {stage}: {type(exc).__name__}: {exc}"
        if main:
            write_results(run_dir / RESULTS_FILENAME, result)
        if isinstance(exc, RunFailed):
            log.error("run failed: %s", exc)
        else:
            log.exception("run failed")
        raise
    result.status = "complete"
    written = False
    try:
        if not run.joint:  # a joint run is the reference of other runs' intransigence
            fill_metrics(result, run)
        account_compute(result, clock.lap(), device)
        if main:
            write_results(run_dir / RESULTS_FILENAME, result)
            written = True
            shutil.rmtree(run_dir / "work", ignore_errors=True)
        dist.wait()
    except KeyboardInterrupt as exc:  # after the last row: say whether the results are complete
        log.warning("%s after the last row", stop_of(exc)[0])
        detail = (f"the run had completed: clbench report {shlex.quote(str(run_dir))} prints it"
                  if written else "every row of R is saved; the same command plus --resume "
                  "completes the results")
        raise RunInterrupted.after(exc, detail) from None
    return result


def _restore(run: RunSpec, run_dir: Path, result: RunResult, model: Any,
             trainee: tuple[Method, list[AddOn]], console: Console
             ) -> tuple[int | None, dict[str, Any] | None]:
    """Load what a resumed run continues from and say so; (the stage trained before the stop
    whose evaluation continues, or None; the progress of a stage stopped in the middle of its
    training, or None). A fresh run loads nothing."""
    done = max(0, len(result.matrix) - 1)
    stages = run.training_stages()
    going = bool(result.matrix) and done < len(stages)
    trained = done + 1 if going and has_checkpoint(run_dir, done + 1) else None
    partial = progress_checkpoint(run_dir, done + 1) if going and not trained else None
    method, addons = trainee
    resume, news = None, ""
    if partial:
        resume = load_progress_checkpoint(partial[1], model, method)
        news = (f"stage {done + 1} continues after step {partial[0]} of "
                f"{stages[done].budget.steps}")
    elif trained or done:
        load_checkpoint(run_dir, trained or done, model, method, addons)
        if trained:
            news = f"stage {trained} was trained before the stop, its evaluation continues"
    else:
        return None, None
    message = f"resuming after stage {done} of {len(stages)}" if done else "resuming"
    message += f"{'; ' if done else ': '}{news}" if news else ""
    log.info("%s (%s)", message, run_dir)
    console.print(message)
    return trained, resume
