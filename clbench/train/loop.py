"""The training loop every method runs: one stage of optimizer steps, driven by hooks.

The loop owns what every method would otherwise repeat: the optimizer and learning-rate schedule
(from the method's :class:`~clbench.train.optim.OptimizerSettings`), gradient checkpointing,
autocast, which items each step draws, micro-batches with gradient accumulation (only the last
one all-reduces), clipping and the optimizer step, token counters and phase times, the per-step
record (logged and kept in the stage report), and checkpoints in the middle of a stage with their
resume. A step whose loss or gradient norm is not finite stops the run or is skipped (the
protocol's `nonfinite_loss`); the heap's free pages go back to the system after every step.

One protocol, :class:`TrainingHooks`, is how anything acts on the loop: the method's own step
logic (:class:`StepHooks`, which adds how a batch is made and what its loss is) and every
continual-learning add-on of the run (`ctx.addons`, :mod:`clbench.train.addons`), called in that
order at each point:

- :meth:`~TrainingHooks.on_stage_start` once before the first step;
- :meth:`~TrainingHooks.choose_examples`: the items of a step, as drawn from the stage's training
  items (:func:`~clbench.train.optim.step_examples`), may be replaced or mixed (replay); this
  is the whole step's list, before it is split over the processes;
- :meth:`StepHooks.build_batch` makes the step's batch from them (SFT: the encoded reference
  solutions; the on-policy methods: sampled, graded and scored rollouts), every
  :attr:`~StepHooks.batch_every` steps;
- per micro-batch, :meth:`StepHooks.loss` plus every hook's :meth:`~TrainingHooks.loss_term` (a
  penalty such as EWC's, a distillation term such as LwF's) is backpropagated;
- :meth:`~TrainingHooks.after_step` after each optimizer step, :meth:`~TrainingHooks.on_stage_end`
  after the last (a Fisher estimate, a merge of weights);
- :meth:`~TrainingHooks.state_dict` / :meth:`~TrainingHooks.load_state_dict` for a checkpoint in
  the middle of the stage (:attr:`~TrainingHooks.resumable` says whether it holds everything).

Scale: a step's loss is a token mean over the supervised tokens of every process. After a batch
is built the loop sets `batch.total_tokens` (the sum over the processes of
:meth:`~StepHooks.supervised_tokens`) and `batch.world`; :meth:`StepBatch.token_mean` divides by
it and scales by the number of processes, so that DDP's averaging of the gradients gives the
one-process step however the tokens fall on the processes. A step with no supervised token on
any process takes no forward or backward (the schedule still advances).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clbench.errors import RunFailed, UserError
from clbench.train.api import StageReport
from clbench.train.cpu import release_free_memory
from clbench.train.losses import token_mean
from clbench.train.optim import (
    Counters,
    OptimizerSettings,
    PhaseClock,
    build_optimizer,
    build_scheduler,
    loop_state,
    optimizer_step,
    rank_share,
    restore_loop,
    set_gradient_checkpointing,
    stage_lr,
    step_examples,
)

if TYPE_CHECKING:
    import torch

    from clbench.tasks.base import Example
    from clbench.train.api import StageContext

log = logging.getLogger("clbench.train.loop")


@dataclass(kw_only=True)
class StepBatch:
    """What one or more optimizer steps train on; set by the loop once the batch is built: the
    supervised tokens of the step summed over the processes, and the number of processes."""

    total_tokens: int | None = None
    world: int = 1

    def token_mean(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This process's term of the step's token mean: sum(per_token * mask) / (T / world), T
        the supervised tokens of all processes (`total_tokens`). Summed over the micro-batches
        and averaged over the processes (what DDP does to the gradients) it is the token mean
        over every process's rows; with one process, `token_mean(per_token, mask, T)` bit for
        bit."""
        if self.total_tokens is None:
            raise ValueError("the batch's total_tokens is unset: the training loop sets it once "
                             "the batch is built")
        return self.rank_term(token_mean(per_token, mask, self.total_tokens))

    def rank_term(self, mean: torch.Tensor) -> torch.Tensor:
        """A mean over the step's supervised tokens of every process as this process's term,
        averaged over the processes like the gradients (itself with one process)."""
        return mean * self.world if self.world > 1 else mean

    def token_share(self, count: float) -> float:
        """A count over this process's supervised tokens as its term of a fraction of the
        step's tokens (averaged over the processes like :meth:`token_mean`)."""
        if self.total_tokens is None:
            raise ValueError("the batch's total_tokens is unset")
        return count * self.world / max(self.total_tokens, 1)


class TrainingHooks:
    """What acts on the training loop (see the module docstring): every method is optional.

    The method's own :class:`StepHooks` and the run's add-ons implement this one protocol; the
    loop calls each point on the method's hooks first, then on the add-ons in the order the run
    lists them."""

    #: Whether :meth:`state_dict` holds everything kept between the steps of a stage (also when
    #: that is nothing), so that the stage can continue from a checkpoint in its middle; a
    #: stage whose hooks do not all say so restarts after a stop.
    resumable: bool = True

    def on_stage_start(self, loop: TrainingLoop) -> None:
        """Once before the first step, also of a stage continued after a stop (then
        :meth:`load_state_dict` follows with what the checkpoint saved)."""

    def choose_examples(self, loop: TrainingLoop, step: int, examples: list[Example]
                        ) -> list[Example]:
        """The items optimizer step `step` trains on, given those drawn for it (the whole
        step's, before the split over the processes, so keep their number): by default
        unchanged. Items of earlier stages keep their stage in their metadata, so they are
        graded by their own task (:meth:`clbench.train.api.StageContext.task_for`)."""
        return examples

    def loss_term(self, loop: TrainingLoop, batch: StepBatch, part: Any
                  ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """A term added to micro-batch `part`'s loss before the backward (a penalty, a
        distillation term), as this part's share of the step's term, and statistics summed over
        the micro-batches (averaged over the processes). None adds nothing. A forward that
        counts goes through `loop.train_model`, one per call on every process."""
        return None, {}

    def after_step(self, loop: TrainingLoop, step: int) -> dict[str, float]:
        """After each optimizer step (e.g. an EMA teacher update); statistics for its record."""
        return {}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        """Once after the last step (e.g. estimate a Fisher, merge weights, summarise into the
        report's `extra`)."""

    def state_dict(self) -> dict[str, Any]:
        """What these hooks keep between steps (e.g. a teacher), for a checkpoint in the middle
        of the stage; empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`on_stage_start`) to continue a stage."""


class StepHooks(TrainingHooks, ABC):
    """A method's step logic: :class:`TrainingHooks` plus how a step's batch is made and what
    its loss is (`build_batch`, `supervised_tokens`, `micro_batches` and `loss` are required)."""

    #: Steps each built batch serves (the on-policy methods' `inner_updates`).
    batch_every: int = 1

    @abstractmethod
    def build_batch(self, loop: TrainingLoop, step: int, examples: list[Example]
                    ) -> tuple[StepBatch, dict[str, float]]:
        """The batch optimizer step `step` (0-based) trains on, made from `examples` (this
        process's share of the step's items), and statistics for the records of the steps that
        use it. Count what it spends in `loop.counters`, time it in `loop.clock`."""

    @abstractmethod
    def supervised_tokens(self, batch: StepBatch) -> int:
        """This process's tokens of `batch` that receive a learning signal (the count the
        loss is a token mean over); counted as `trained_tokens` at every update."""

    @abstractmethod
    def micro_batches(self, batch: StepBatch) -> list[Any]:
        """The parts of `batch` each forward and backward pass takes."""

    @abstractmethod
    def loss(self, loop: TrainingLoop, batch: StepBatch, part: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (this process's term of the step's loss: use
        :meth:`StepBatch.token_mean`) and statistics summed over the micro-batches. Training
        forwards go through `loop.train_model`. Under several processes every process must run
        one forward through it per call (their backwards meet in one all-reduce): a part with
        nothing to learn returns a loss without a graph, and the loop runs
        :meth:`zero_weighted_forward` for it."""

    def zero_weighted_forward(self, loop: TrainingLoop, batch: StepBatch, part: Any
                              ) -> torch.Tensor:
        """0 times a forward of one row of `part` through `loop.train_model`: a loss whose
        backward reaches every parameter with a zero gradient, for a process whose part has no
        loss of its own while others train (several processes only)."""
        raise NotImplementedError(f"{type(self).__name__} returned a loss without a graph under "
                                  "several processes but has no zero_weighted_forward")

    def part_sequences(self, batch: StepBatch, part: Any
                       ) -> tuple[list[list[int]], list[list[int]]]:
        """The prompt and completion token ids of a micro-batch's rows (what an add-on's loss
        term scores, e.g. LwF's divergence from the stage-start model)."""
        raise UserError(f"the method's step hooks ({type(self).__name__}) do not give their "
                        "batches' token ids (StepHooks.part_sequences), which an add-on of this "
                        "run (LwF, say) needs: run the method without it")

    def step_stats(self, batch: StepBatch) -> dict[str, float]:
        """Statistics of the batch for the record of every step that uses it."""
        return {}


class TrainingLoop:
    """One stage of optimizer steps for `ctx` under `settings`, driven by the method's `hooks`
    and the run's add-ons (`ctx.addons`)."""

    def __init__(self, ctx: StageContext, settings: OptimizerSettings, hooks: StepHooks) -> None:
        self.ctx = ctx
        self.dist = ctx.dist
        self.model = ctx.model              # plain student: generation, copies, no-grad scoring
        self.train_model = ctx.train_model  # prepared student: forwards whose gradients count
        self.settings = settings
        self.hooks = hooks
        self.addons: list[TrainingHooks] = list(ctx.addons)
        #: The method's hooks, then the add-ons: the order every point is called in.
        self.all_hooks: list[TrainingHooks] = [hooks, *self.addons]
        self.lr = stage_lr(settings, ctx.budget)
        self.clock = PhaseClock()
        self.counters = Counters()
        # on the trained weights: the shards when the student is sharded, else `model`'s own
        set_gradient_checkpointing(self.train_model, settings)
        self.optimizer = self.dist.prepare_optimizer(build_optimizer(self.train_model, settings,
                                                                     self.lr))
        self.scheduler = build_scheduler(self.optimizer, settings, ctx.budget.steps)

    def step_items(self, step: int) -> list[Example]:
        """This process's share of the items step `step` trains on: the stage's drawn in their
        seeded order (:func:`~clbench.train.optim.step_examples`), as every hook chose them."""
        ctx, dist = self.ctx, self.dist
        items = step_examples(ctx.train_examples, ctx.budget.prompts_per_step, step, ctx.seed,
                              stage=ctx.stage_name)
        for hooks in self.all_hooks:
            items = hooks.choose_examples(self, step, items)
        return rank_share(items, dist.process_index, dist.num_processes, ctx.stage_name)

    def new_batch(self, step: int) -> tuple[StepBatch, dict[str, float]]:
        """The hooks' batch for step `step`, with its token total over the processes set."""
        batch, stats = self.hooks.build_batch(self, step, self.step_items(step))
        batch.world = self.dist.num_processes
        batch.total_tokens = self.dist.sum_int(self.hooks.supervised_tokens(batch))
        return batch, stats

    def part_loss(self, batch: StepBatch, part: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss backpropagated for micro-batch `part`: the method's, then every hook's term
        added, with their statistics."""
        hooks = self.hooks
        loss, stats = hooks.loss(self, batch, part)
        stats = dict(stats)
        if loss.grad_fn is None and self.dist.num_processes > 1:
            zero = hooks.zero_weighted_forward(self, batch, part)
            loss = loss.detach().to(zero.device) + zero
        for each in self.all_hooks:
            term, term_stats = each.loss_term(self, batch, part)
            if term is not None:
                loss = loss + term.to(loss.device)
            for k, v in term_stats.items():
                stats[k] = stats.get(k, 0.0) + float(v)
        return loss, stats

    def update(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step on `batch`: loss, gradient norm, lr and the loss statistics."""
        hooks, dist = self.hooks, self.dist
        self.train_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        sums: dict[str, float] = {}
        # No process has a token to learn from: no forward or backward on any, and the
        # optimizer skips every parameter (no decay-only update); the schedule advances.
        parts = [] if batch.total_tokens == 0 else hooks.micro_batches(batch)
        with self.clock.phase("backward"):
            for i, part in enumerate(parts):
                with dist.no_sync(self.train_model, sync=i == len(parts) - 1):
                    loss, stats = self.part_loss(batch, part)
                    if loss.requires_grad:
                        dist.backward(loss)
                total_loss += float(loss.detach())
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        with self.clock.phase("step"):
            finite = not dist.any_rank(not math.isfinite(total_loss))  # alike on every rank
            grad_norm, lr, updated = optimizer_step(self.train_model, self.optimizer,
                                                    self.scheduler, self.settings.max_grad_norm,
                                                    finite)
            if updated:
                dist.sync_student(self.train_model, self.model)
        self.train_model.eval()
        record = {"loss": total_loss, "grad_norm": grad_norm, "lr": lr, **sums}
        if not updated:
            self.counters.add("skipped_steps", 1)
            return {"nonfinite": record}
        self.counters.add("trained_tokens", hooks.supervised_tokens(batch))
        self.counters.add("optimizer_steps", 1)
        return record

    def _nonfinite(self, step: int, values: dict[str, float]) -> dict[str, float]:
        """A step whose loss or gradient norm is not finite: the run stops (the protocol's
        `nonfinite_loss: stop`) or the step's record keeps its finite values and says it was
        skipped (`skip`); no NaN reaches a record, a summary or a table."""
        ctx = self.ctx
        where = (f"stage {ctx.stage_index} ({ctx.stage_name}) step {step + 1} of "
                 f"{ctx.budget.steps}: loss {values['loss']:.4g}, gradient norm "
                 f"{values['grad_norm']:.4g}")
        if ctx.nonfinite_loss != "skip":
            raise RunFailed(f"{where}: training diverged, so the run stops here "
                            "(protocol.nonfinite_loss: stop; `skip` leaves such steps out)")
        log.warning("%s: the step is skipped (protocol.nonfinite_loss: skip)", where)
        return {**{k: v for k, v in values.items() if math.isfinite(v)}, "skipped_step": 1.0}

    @property
    def resumable(self) -> bool:
        """Whether every hook's state holds what it keeps between steps."""
        return all(h.resumable for h in self.all_hooks)

    def hooks_state(self) -> dict[str, Any]:
        """Every hook's :meth:`~TrainingHooks.state_dict`, for a checkpoint."""
        return {"method": self.hooks.state_dict(),
                "addons": [a.state_dict() for a in self.addons]}

    def load_hooks_state(self, state: dict[str, Any]) -> None:
        """Put :meth:`hooks_state` back (after every hook's `on_stage_start`)."""
        self.hooks.load_state_dict(state["method"])
        for addon, saved in zip(self.addons, state["addons"], strict=True):
            addon.load_state_dict(saved)

    def run(self) -> StageReport:
        """Every optimizer step of the stage, under the run's autocast; each step's record goes
        to `ctx.log_step` and into the report."""
        self.ctx.addons_applied = True  # the run checks that a method with add-ons ran them
        with self.dist.autocast():
            return self._run()

    def _run(self) -> StageReport:
        ctx, hooks = self.ctx, self.hooks
        report = StageReport()
        for each in self.all_hooks:
            each.on_stage_start(self)
        start = 0
        if ctx.resume is not None:  # continuing the stage after a stop
            self.load_hooks_state(ctx.resume["hooks"])
            start = restore_loop(ctx.resume, self.dist, self.optimizer, self.scheduler,
                                 self.clock, self.counters, report.steps, self.train_model)
        every = max(1, hooks.batch_every)
        batch: StepBatch | None = None
        batch_stats: dict[str, float] = {}
        for step in range(start, ctx.budget.steps):
            started = time.perf_counter()
            if batch is None or step % every == 0:
                batch, batch_stats = self.new_batch(step)
            update = self.update(batch)
            if "nonfinite" in update:
                update = self._nonfinite(step, update["nonfinite"])
            record: dict[str, Any] = {"step": step + 1, **update}
            record.update(hooks.step_stats(batch))
            record.update(batch_stats)
            for each in self.all_hooks:
                record.update(each.after_step(self, step))
            record["seconds"] = time.perf_counter() - started
            # the step's activations and rollouts are freed: their heap pages go back, so the
            # next step's allocations start from a heap without holes (docs/performance.md)
            release_free_memory()
            record = self.dist.mean_record(record)
            report.steps.append(record)
            ctx.log_step(record)
            # at a batch boundary: no batch is reused past this step
            if self.resumable and (step + 1) % every == 0:
                ctx.save_progress(step, lambda step=step: {
                    **loop_state(step, self.dist.optimizer_state(self.train_model,
                                                                 self.optimizer),
                                 self.scheduler, self.clock, report.steps),
                    "hooks": self.hooks_state()}, self.counters.values)
        report.counters = self.dist.sum_counts(self.counters.values)
        report.wall_time = self.clock.snapshot()
        report.extra["lr"] = self.lr
        for each in self.all_hooks:
            each.on_stage_end(self, report)
        return report
