"""What a run will cost on this machine before it starts: the estimate `clbench run --plan`
prints.

Priced by a short calibration with the run's own model, device, precision and method: one
evaluation batch of each task column (items spread over the column's prompt lengths) and one
training step of each stage (the method's own step, on a copy of the model, from the stage's
first items). A run then costs, for every row, each column's batches at its batch's time, and
for every stage its steps at its step's time. Left out, and said so: lm-eval probes, checkpoint
writes, and one-time work of a stage beyond its first step (which the calibration step
includes, so training errs high by one setup per stage).

Disk: a run keeps one checkpoint of the last trained stage and one of the stage in progress,
and writes a new one before it drops the old: at most three checkpoints (the student's weights
and the method's state: optimizer moments, a teacher's copy) at once.
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clbench.engine.api import Method
    from clbench.engine.distributed import Distributed
    from clbench.rows import ColumnPlan
    from clbench.specs import RunSpec
    from clbench.tasks.base import Example, TaskSource

#: Checkpoints on disk at once at most: the last trained stage's, the latest of the stage in
#: progress, and its successor being written.
CHECKPOINTS_AT_ONCE = 3


@dataclass(frozen=True)
class ColumnCost:
    """One task column: its items, evaluation batch size and the measured seconds of a batch."""

    name: str
    items: int
    batch_size: int
    batch_seconds: float

    @property
    def seconds(self) -> float:
        """One row's evaluation of the column."""
        return math.ceil(self.items / self.batch_size) * self.batch_seconds


@dataclass(frozen=True)
class StageCost:
    """One training stage: its steps and the measured seconds of one."""

    name: str
    steps: int
    step_seconds: float

    @property
    def seconds(self) -> float:
        return self.steps * self.step_seconds


@dataclass(frozen=True)
class RunEstimate:
    """A run's projected wall time (evaluation of every row, training of every stage) and the
    disk its checkpoints take at most."""

    rows: int
    columns: tuple[ColumnCost, ...]
    stages: tuple[StageCost, ...]
    checkpoint_bytes: int
    not_estimated: tuple[str, ...] = ()  # columns left out (lm-eval probes)

    @property
    def eval_seconds(self) -> float:
        return self.rows * sum(c.seconds for c in self.columns)

    @property
    def train_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def seconds(self) -> float:
        return self.eval_seconds + self.train_seconds

    @property
    def disk_bytes(self) -> int:
        return CHECKPOINTS_AT_ONCE * self.checkpoint_bytes


def spread_batch(examples: Sequence[Example], batch_size: int,
                 length: Callable[[Example], int]) -> list[Example]:
    """`batch_size` items spread evenly over the column's prompt lengths (the k-th of every
    len/batch_size in length order): a batch as long as the column's average batch, as
    evaluation batches prompts of similar length."""
    ordered = sorted(examples, key=length, reverse=True)
    if len(ordered) <= batch_size:
        return ordered
    stride = len(ordered) / batch_size
    return [ordered[int(k * stride + stride / 2)] for k in range(batch_size)]


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) state: what `torch.save` writes, give or take
    the pickle around it."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


@dataclass
class Calibration:
    """What the calibration works with: the run, its accelerator, model and method."""

    run: RunSpec
    dist: Distributed
    model: Any
    tokenizer: Any
    method: Method
    on_step: Callable[[str], None] = lambda what: None


def estimate_run(cal: Calibration, plans: Sequence[ColumnPlan],
                 stage_tasks: Sequence[TaskSource]) -> RunEstimate:
    """Measure a batch of every task column and a step of every stage; the run's estimate."""
    columns = tuple(_column_cost(cal, plan) for plan in plans if plan.task is not None)
    stages, checkpoint = [], _weights_bytes(cal.model)
    for index, (spec, task) in enumerate(zip(cal.run.training_stages(), stage_tasks), start=1):
        cost, method_state = _stage_cost(cal, index, spec, task)
        stages.append(cost)
        checkpoint = max(checkpoint, _weights_bytes(cal.model) + method_state)
    return RunEstimate(rows=1 + len(stages), columns=columns, stages=tuple(stages),
                       checkpoint_bytes=checkpoint,
                       not_estimated=tuple(p.name for p in plans if p.task is None))


def _column_cost(cal: Calibration, plan: ColumnPlan) -> ColumnCost:
    from clbench.engine.rollout import encode_chat
    from clbench.evaluation import evaluate_column, make_generate_fn

    assert plan.task is not None
    decoding = cal.run.suite.protocol.decoding
    batch = spread_batch(plan.examples, decoding.batch_size,
                         lambda ex: len(encode_chat(cal.tokenizer, ex.messages)))
    cal.on_step(f"evaluation batch of {plan.name}")
    generate = make_generate_fn(cal.model, cal.tokenizer, decoding)
    started = time.perf_counter()
    with cal.dist.autocast():
        evaluate_column(plan.name, plan.task, batch, generate, batch_size=len(batch) or 1,
                        bootstrap_samples=1)
    return ColumnCost(plan.name, len(plan.examples), decoding.batch_size,
                      time.perf_counter() - started)


def _stage_cost(cal: Calibration, index: int, spec: Any, task: TaskSource
                ) -> tuple[StageCost, int]:
    """One step of the stage by the method, on a copy of the model: its seconds and the size
    of the method's state after it (what a checkpoint holds besides the weights)."""
    from clbench.engine.api import StageContext

    budget = spec.budget.model_copy(update={"steps": 1})
    examples = task.examples("train", spec.task.seed,
                             min(spec.task.train_size, budget.prompts_per_step))
    cal.on_step(f"training step of {spec.name}")
    student = copy.deepcopy(cal.model)
    method = copy.deepcopy(cal.method)
    with tempfile.TemporaryDirectory(prefix="clbench-plan-") as work:
        ctx = StageContext(model=student, tokenizer=cal.tokenizer, task=task,
                           train_examples=examples, budget=budget, stage_index=index,
                           stage_name=spec.name, seed=cal.run.seed, device=cal.dist.device,
                           work_dir=Path(work), dist=cal.dist)
        started = time.perf_counter()
        method.train_stage(ctx)
        seconds = time.perf_counter() - started
    state = state_bytes(method.state_dict())
    del student, method
    return StageCost(spec.name, spec.budget.steps, seconds), state


def _weights_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())
