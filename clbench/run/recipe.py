"""One run, read top to bottom: :class:`RunRecipe`.

A run fills the accuracy matrix R of one suite x method (with its add-ons) x seed: row 0 is the
base model, row t the model after stage t. The recipe:

1. **sets up**: builds the plugins and the accelerator, claims the run folder, draws every item
   and loads the model (all before the folder is started, so a mistake leaves nothing behind),
   then the result so far, the stage observers and what a stopped run continues from;
2. **evaluates row 0** (:mod:`clbench.run.baserow`: once per suite and model, cached);
3. for every stage still to do, **trains it** (:mod:`clbench.run.stages`; or takes it as trained
   before a stop) and keeps it, then **evaluates its row** (:mod:`clbench.run.rows`), after
   which the observers (:mod:`clbench.run.observers`: diagnostics, cost, the results file) act;
4. **finishes**: the metrics of R, the complete result.

The run folder stays resumable at every moment:

    run.json                  identity of the run (suite, method and add-ons, configs, model, seed)
    results.json              the partial, then complete, result (atomic writes)
    run.log                   log file
    items/row{t}/{col}.jsonl  per-item evaluation records behind every cell
    items/row{t}/cells.json   the cells of row t's columns evaluated so far
    stages/stage{t}.json      the method's full stage report (every step)
    checkpoints/stage{t}/     student weights, method and add-on state, RNG states of the last
                              stage trained
    checkpoints/stage{t}-step{k}/  the same after k steps of the stage in progress, with the
                              training loop's progress (every `checkpoint_minutes`)

A stage is checkpointed as soon as it is trained, before its row is evaluated, and counts as done
once its row is in results.json. A run killed at any moment resumes from what is on disk: during
training, the stage continues from its last step checkpoint; during evaluation, the trained
stage is loaded and only the columns not yet saved are evaluated. Every stage re-seeds all RNGs
from (run seed, stage index) and a step checkpoint holds the RNG states, so a resumed run draws
exactly the numbers an uninterrupted run draws and, on CPU, ends with a bit-identical R.

Launched as several processes (accelerate, torchrun), every process runs this recipe on its share
of the work (:mod:`clbench.train.distributed`): training is data-parallel, each column's items are
split over the processes and gathered in item order, lm-eval probes run on the main process.
Only the main process writes files, logs and prints; a barrier follows each write.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from clbench.adapters import is_adapted, merge_into_base
from clbench.errors import RunFailed, UserError, stop_of
from clbench.eval.records import examples_of
from clbench.plugins import registry
from clbench.progress import run_progress
from clbench.results import RESULTS_FILENAME, RunResult, StageRecord, new_result, write_results
from clbench.run.baserow import base_row, evaluation_stamp
from clbench.run.context import RunContext
from clbench.run.observers import ComputeAccount, stage_observers, write
from clbench.run.rows import evaluate_row, forget_saved_cells, to_cells
from clbench.run.rundir import (
    RunDirError,
    check_run_dir,
    claimed_run_folder,
    has_checkpoint,
    load_checkpoint,
    load_progress_checkpoint,
    progress_checkpoint,
    prune_checkpoints,
    run_identity,
    what_is_saved,
)
from clbench.run.scores import metric_values
from clbench.run.setup import (
    check_lm_eval_probes,
    check_sharding_support,
    draw_items,
    load_model,
    make_distributed,
    start_peak_memory,
    warn_if_another_checkout,
)
from clbench.run.stages import keep_trained_stage, train_stage, trained_report
from clbench.run.trackers import RunTrackers, prepare_environment
from clbench.seeding import derive_seed, seed_everything
from clbench.spec.schema import RunSpec
from clbench.tasks.code.sandbox import sandbox_kind
from clbench.train.cpu import allocator_hint, release_free_memory

if TYPE_CHECKING:
    from clbench.train.api import StageReport

log = logging.getLogger("clbench.run.recipe")


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


def execute(run: RunSpec, resume: bool = False, console: Console | None = None) -> RunResult:
    """Run (or resume) one run and return its result: :meth:`RunRecipe.execute`; a launched
    run's processes then part (:meth:`Distributed.close`)."""
    recipe = RunRecipe(run, console)
    result = recipe.execute(resume)
    recipe.dist.close()
    return result


class RunRecipe:
    """One run of `run` (see the module docstring). Progress bars and the few messages a user
    must see go to `console` (the CLI's); without one nothing is shown. Printing the result is
    the caller's (:func:`clbench.report.runs.print_summary`)."""

    def __init__(self, run: RunSpec, console: Console | None = None) -> None:
        self.run = run
        self.run_dir = Path(run.out_dir)
        self.diagnostics = run.suite.protocol.diagnostics
        self.method = registry.build_method(run.method)
        self.addons = registry.build_addons(run.addons)
        self.identity = run_identity(run)
        self.dist = make_distributed(run)
        check_sharding_support(run, self.method, self.addons, self.dist)
        self.console = console if console is not None and self.dist.is_main \
            else Console(quiet=True)
        self.at = "row 0"  # what the run is doing, for a stop's log line

    # -- 1. set up -------------------------------------------------------------------------------

    def execute(self, resume: bool) -> RunResult:
        """Run (or resume) the run. Raises :class:`clbench.run.rundir.RunDirError` for a folder
        of another run, :class:`RunInterrupted` on Ctrl-C or SIGTERM (after saving what is
        complete). A method that raises leaves a `failed` result."""
        # A complete run is only read (a results folder may be read-only); another run's folder
        # is refused before anything is written to it.
        previous = check_run_dir(self.run_dir, self.identity, resume)
        self.dist.wait()  # every process has looked at the folder before the main one writes
        if self.complete(previous):
            return previous  # type: ignore[return-value]
        with claimed_run_folder(self.run_dir, self.identity, resume, self.dist) as folder:
            if self.complete(folder.previous):
                return folder.previous  # type: ignore[return-value]
            # Every mistake that can be found before anything is computed is found before the
            # folder is started: a corrected command may then use the same --out.
            check_lm_eval_probes(self.run)
            start_peak_memory(self.dist.device)
            done = len(folder.previous.matrix) if folder.previous else 1
            self.items = draw_items(self.run, first_stage=done)
            self.model, self.tokenizer = load_model(self.run, self.dist)
            folder.start(self.identity)
            self.dist.wait()
            self.set_up(folder.previous)
            return self.stream()

    def complete(self, previous: RunResult | None) -> bool:
        if previous is None or previous.status != "complete":
            return False
        self.console.print(f"[green]{self.run_dir} is already complete[/]")
        return True

    def set_up(self, previous: RunResult | None) -> None:
        """The result so far (a fresh one with its provenance), the observers, what a stopped
        run continues from, the student prepared for training."""
        run, dist = self.run, self.dist
        origin = registry.plugin_origin(registry.METHODS_GROUP, run.method.name)
        if dist.is_main:
            warn_if_another_checkout(run.method.name, origin)
        tasks = [s.task for s in run.suite.stages] + \
            [p.task for p in run.suite.probes if p.task is not None]
        self.result = previous or new_result(
            run, origin, {t.name: registry.task_class(t).version for t in tasks},
            [registry.plugin_origin(registry.ADDONS_GROUP, a.name) for a in run.addons],
            registry.run_defaults(run))
        if any(registry.task_class(t).runs_code for t in tasks):  # how code was confined
            self.result.versions["code_sandbox"] = sandbox_kind()
        # every setting as this sitting runs it (fields added since the run began included:
        # the folder's check made sure they do what the run did)
        self.result.method.config = dict(run.method.params)
        self.result.status, self.result.error = "partial", None  # a failed run resumed
        self.compute = ComputeAccount(self)
        self.trackers = self._start_trackers()
        self.observers = stage_observers(self)
        self.done = max(0, len(self.result.matrix) - 1)  # stages whose row is in the result
        self.trained, self.resume = self.restore()
        # once per run (DDP keeps its buffers), on the weights the run continues from
        self.train_model = dist.prepare_student(self.model)
        model = self.model
        self.result.model.resolved = {
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(dist.device), **dist.describe()}
        if dist.device.type == "cpu" and (hint := allocator_hint()) is not None:
            log.info("%s", hint)
            self.console.print(f"[dim]{escape(hint)}[/]", soft_wrap=True)

    def _start_trackers(self) -> RunTrackers | None:
        """The run's experiment trackers (`--report-to`), started; None without any."""
        if not self.run.report_to:
            return None
        prepare_environment(self.run.report_to, self.run_dir)
        trackers = RunTrackers(self.run, self.dist.accelerator)
        trackers.start()
        return trackers

    def restore(self) -> tuple[int | None, dict[str, Any] | None]:
        """Load what a resumed run continues from and say so: (the stage trained before the
        stop whose evaluation continues, or None; the progress of a stage stopped in its
        middle, or None). A fresh run loads nothing."""
        done, stages = self.done, self.run.training_stages()
        going = bool(self.result.matrix) and done < len(stages)
        trained = done + 1 if going and has_checkpoint(self.run_dir, done + 1) else None
        partial = progress_checkpoint(self.run_dir, done + 1) if going and not trained else None
        resume, news = None, ""
        if partial:
            try:
                resume = load_progress_checkpoint(partial[1], self.model, self.method)
                news = f"stage {done + 1} continues after step {partial[0]} of " \
                    f"{stages[done].budget.steps}"
            except RunDirError as exc:  # damaged: the stage starts again from the last intact
                log.warning("%s", exc)
                self.console.print(f"[yellow]{escape(str(exc))}[/]", soft_wrap=True)
                news = f"stage {done + 1} trains again from its start (its checkpoint after " \
                    f"step {partial[0]} is damaged)"
                if done:
                    load_checkpoint(self.run_dir, done, self.model, self.method, self.addons)
        elif trained or done:
            load_checkpoint(self.run_dir, trained or done, self.model, self.method, self.addons)
            if trained:
                news = f"stage {trained} was trained before the stop, its evaluation continues"
        else:
            return None, None
        message = f"resuming after stage {done} of {len(stages)}" if done else "resuming"
        message += f"{'; ' if done else ': '}{news}" if news else ""
        log.info("%s (%s)", message, self.run_dir)
        self.console.print(message)
        return trained, resume

    # -- 2, 3: the rows and the stages ---------------------------------------------------------

    def stream(self) -> RunResult:
        """Row 0, then every stage still to do and its row; then :meth:`finish`."""
        run, dist = self.run, self.dist
        stages = run.training_stages()
        try:
            with run_progress(self.console, disable=not dist.is_main) as progress, \
                    dist.autocast():
                self.context = RunContext(
                    run=run, run_dir=self.run_dir, model=self.model, tokenizer=self.tokenizer,
                    progress=progress, plans=self.items.plans, dist=dist,
                    stamp=evaluation_stamp(run, self.items.plans, self.result.model.resolved),
                    train_model=self.train_model, console=self.console,
                    on_saved=self.compute.saved, tasks=self.items.tasks, addons=self.addons,
                    trackers=self.trackers)
                if not self.result.matrix:
                    self.evaluate_base_row()
                bar = progress.add_task("stages", total=len(stages), completed=self.done)
                for stage in range(self.done + 1, len(stages) + 1):
                    self.at = f"stage {stage}"
                    self.evaluate(stage, self.train(stage))
                    progress.advance(bar)
                    if self.result.status == "collapsed":
                        log.warning("%s; the remaining stages are not trained (collapse.stop)",
                                    self.result.error)
                        return self.result
        except KeyboardInterrupt as exc:
            log.warning("%s during %s", stop_of(exc)[0], self.at)
            if self.trackers is not None:  # what was logged reaches the tracker's files
                self.trackers.finish()
            kept = what_is_saved(self.run_dir, len(self.result.matrix), len(self.result.columns))
            raise RunInterrupted.after(exc, f"{kept}. Continue with the same command plus "
                                       "--resume") from None
        except Exception as exc:
            self.failed(exc)
            raise
        return self.finish()

    def evaluate_base_row(self) -> None:
        """Row 0, the base model's (from the cache when an earlier run computed it)."""
        seed_everything(derive_seed(self.run.seed, 0))
        self.result.matrix.append(base_row(self.context, self.result))
        self.result.row_labels.append("base")
        for observer in self.observers:
            observer.after_row(self, 0, None, None)

    def train(self, stage: int) -> StageReport:
        """Stage `stage` trained (or taken as trained before a stop) and kept: its report, then
        its checkpoint, before its row is evaluated."""
        main = self.dist.is_main
        if stage == self.trained:
            if main:  # a stop between saving and pruning may have left some behind
                prune_checkpoints(self.run_dir, stage)
            return trained_report(self.run_dir, stage)
        if main:  # cells scored with the model about to be retrained
            forget_saved_cells(self.run_dir, stage)
        report = train_stage(self.context, stage, self.method, self.items.stage_tasks[stage - 1],
                             self.items.train_sets[stage - 1],  # type: ignore[arg-type]
                             resume=self.resume)
        self.resume = None  # taken: its optimizer state is not kept for later stages
        if self.run.model.adapter.scope == "stage" and is_adapted(self.model):
            merge_into_base(self.model)  # the next stage trains a fresh adapter
        for observer in self.observers:
            observer.after_training(self, stage, report)
        if main:
            keep_trained_stage(self.run_dir, stage, report, self.model, self.method, self.addons)
            self.compute.saved()
        self.dist.wait()
        return report

    def evaluate(self, stage: int, report: StageReport) -> None:
        """Row `stage` of R, the stage's record, then the observers."""
        name = self.run.training_stages()[stage - 1].name
        seed_everything(derive_seed(self.run.seed, stage, "eval"))
        self.result.matrix.append(to_cells(evaluate_row(self.context, stage)))
        self.result.row_labels.append(f"after {name}")
        record = StageRecord(index=stage, name=name, summary=report.summary(),
                             counters=report.counters, wall_time=dict(report.wall_time),
                             extra=json.loads(json.dumps(report.extra, default=str)))
        self.result.stages.append(record)
        for observer in self.observers:
            observer.after_row(self, stage, record, report)
        release_free_memory()  # before the next stage allocates its optimizer state
        log.info("stage %d (%s) done", stage, name)

    # -- 4. finish -------------------------------------------------------------------------------

    def finish(self) -> RunResult:
        """The metrics of R and the complete result (a joint run, the reference of other runs'
        intransigence, has no continual metrics)."""
        result = self.result
        result.status = "complete"
        written = False
        try:
            result.examples = examples_of(self.run_dir, result)
            if not self.run.joint:
                result.metrics = metric_values(result, self.run.suite.protocol)
                for name, metric in result.metrics.items():
                    if metric.value is None:
                        log.info("metric %s undefined: %s", name, metric.note)
            self.compute.after_row(self, len(result.matrix) - 1, None, None)
            write(self)
            written = True
            if self.trackers is not None:
                self.trackers.log_metrics({k: m.value for k, m in result.metrics.items()})
                self.trackers.finish()
            if self.dist.is_main:
                shutil.rmtree(self.run_dir / "work", ignore_errors=True)
        except KeyboardInterrupt as exc:  # after the last row: say whether the results are done
            log.warning("%s after the last row", stop_of(exc)[0])
            detail = (f"the run had completed: clbench report {shlex.quote(str(self.run_dir))} "
                      "prints it" if written else "every row of R is saved; the same command "
                      "plus --resume completes the results")
            raise RunInterrupted.after(exc, detail) from None
        return result

    def failed(self, exc: Exception) -> None:
        """A method or the run raised: the result says so, and the log has the traceback."""
        self.result.status = "failed"
        if getattr(self, "trackers", None) is not None:
            self.trackers.finish()
        self.result.error = str(exc) if isinstance(exc, RunFailed) else \
            f"{self.at}: {type(exc).__name__}: {exc}"
        if self.dist.is_main:  # no barrier: the other processes may not get here
            write_results(self.run_dir / RESULTS_FILENAME, self.result)
        if isinstance(exc, RunFailed):
            log.error("run failed: %s", exc)
        else:
            log.exception("run failed")
