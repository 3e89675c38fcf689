"""What a run will cost on this machine before it starts: the estimate `clbench run --plan`
prints.

Priced by a short calibration with the run's own model, device, precision and method: one
evaluation batch of each task column (the items around its median prompt length, batched as a
run batches them) and two training steps of each stage (the
method's own steps, on a copy of the model, from the stage's first items; the second is timed,
the first also pays the stage's setup). A run then costs, for every row, each column's items at
its batch's rate, and for every stage its steps at its step's time. The diagnostics after each
stage: parameter drift from one decomposition of every weight matrix (a stage costs three on
the first stage, the base's, its own and the comparisons, two on later ones: measured 22 and
14 s on the embedded model against a 7-second pass), response drift from one scoring of the
probe prompts by two models with responses as long as the decoding allows (an upper bound; the
base model's half only on the first stage, later ones take it as kept).
Left out, and said so: lm-eval probes, checkpoint writes, model loading, the prompt distances
(seconds), and a stage's one-time setup.

Disk: a run keeps the checkpoint of the last trained stage (the student's weights and the
method's state, e.g. a teacher) and one of the stage in progress (the same and the method's
progress: optimizer moments, schedule), and writes a new one of those before it drops the old:
at most one stage checkpoint and two step checkpoints at once, sized from what the calibration
steps hand to the run's checkpointing.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clbench.run.rows import ColumnPlan
    from clbench.spec.schema import RunSpec
    from clbench.tasks.base import Example, TaskSource
    from clbench.train.api import Method
    from clbench.train.distributed import Distributed


@dataclass(frozen=True)
class ColumnCost:
    """One task column: its items, evaluation batch size and the measured seconds of a batch."""

    name: str
    items: int
    batch_size: int
    batch_seconds: float

    @property
    def seconds(self) -> float:
        """One row's evaluation of the column: its items at the measured batch's rate (the
        last, partial batch costs its share: its rows decode as the others' do)."""
        return self.items / self.batch_size * self.batch_seconds


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
    stage_checkpoint_bytes: int  # weights and the method's state
    step_checkpoint_bytes: int  # the same and the method's progress in the stage
    not_estimated: tuple[str, ...] = ()  # columns left out (lm-eval probes)
    base_weights_bytes: int = 0  # the base model's parameters, kept for the drift diagnostics
    diagnostics_seconds: float = 0.0  # drift diagnostics after every stage

    @property
    def eval_seconds(self) -> float:
        return self.rows * sum(c.seconds for c in self.columns)

    @property
    def train_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def seconds(self) -> float:
        return self.eval_seconds + self.train_seconds + self.diagnostics_seconds

    @property
    def disk_bytes(self) -> int:
        """The last stage's checkpoint, the latest step's and its successor being written, and
        the base weights parameter drift is measured against."""
        return self.stage_checkpoint_bytes + 2 * self.step_checkpoint_bytes + \
            self.base_weights_bytes


def middle_batch(examples: Sequence[Example], batch_size: int,
                 length: Callable[[Example], int]) -> list[Example]:
    """The `batch_size` items around the median prompt length: a batch as a run makes them
    (it batches prompts of similar length), of the column's typical length."""
    ordered = sorted(examples, key=length, reverse=True)
    start = max(0, min(len(ordered) - batch_size, (len(ordered) - batch_size) // 2))
    return ordered[start:start + batch_size]


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
    """What the calibration works with: the run, its accelerator, model, method and add-ons
    (measured as they act in a first stage: a penalty anchored at a stage's end, EWC's, costs
    nothing there)."""

    run: RunSpec
    dist: Distributed
    model: Any
    tokenizer: Any
    method: Method
    on_step: Callable[[str], None] = lambda what: None
    addons: Sequence[Any] = ()


def estimate_run(cal: Calibration, plans: Sequence[ColumnPlan],
                 stage_tasks: Sequence[TaskSource],
                 train_sets: Sequence[Sequence[Example]]) -> RunEstimate:
    """Measure a batch of every task column and two steps of every stage (from its training
    items, as the run draws them); the run's estimate."""
    columns = tuple(_column_cost(cal, plan) for plan in plans if plan.task is not None)
    weights = _weights_bytes(cal.model)
    stages, method_state, progress = [], 0, 0
    for index, (spec, task, items) in enumerate(
            zip(cal.run.training_stages(), stage_tasks, train_sets), start=1):
        cost, sizes = _stage_cost(cal, index, spec, task, items)
        stages.append(cost)
        method_state, progress = max(method_state, sizes[0]), max(progress, sizes[1])
    return RunEstimate(rows=1 + len(stages), columns=columns, stages=tuple(stages),
                       diagnostics_seconds=_diagnostics_seconds(cal, plans, len(stages)),
                       stage_checkpoint_bytes=weights + method_state,
                       step_checkpoint_bytes=weights + method_state + progress,
                       not_estimated=tuple(p.name for p in plans if p.task is None),
                       base_weights_bytes=weights if (
                           cal.run.suite.protocol.diagnostics.weight_drift.enabled
                           or cal.run.suite.protocol.diagnostics.response_drift.enabled) else 0)


def _column_cost(cal: Calibration, plan: ColumnPlan) -> ColumnCost:
    from clbench.eval.column import evaluate_column, run_generate_fn
    from clbench.train.rollout import encode_chat

    assert plan.task is not None
    decoding = cal.run.suite.protocol.decoding
    generate, prompts = run_generate_fn(cal.model, cal.tokenizer, decoding, cal.run.model)
    batch = middle_batch(plan.examples, prompts,
                         lambda ex: len(encode_chat(cal.tokenizer, ex.messages)))
    cal.on_step(f"evaluation batch of {plan.name}")
    started = time.perf_counter()
    with cal.dist.autocast():
        evaluate_column(plan.name, plan.task, batch, generate, batch_size=len(batch) or 1,
                        bootstrap_samples=1)
    return ColumnCost(plan.name, len(plan.examples), len(batch) or 1,
                      time.perf_counter() - started)


def _stage_cost(cal: Calibration, index: int, spec: Any, task: TaskSource,
                items: Sequence[Example]) -> tuple[StageCost, tuple[int, int]]:
    """Two steps of the stage by the method, on a copy of the model: the second's seconds, and
    the sizes of the method's state and of the progress it hands to a step checkpoint."""
    from clbench.train.api import StageContext

    budget = spec.budget.model_copy(update={"steps": 2})
    examples = list(items[:2 * budget.prompts_per_step])
    cal.on_step(f"training steps of {spec.name}")
    student = copy.deepcopy(cal.model)
    method, addons = copy.deepcopy(cal.method), copy.deepcopy(list(cal.addons))
    progress: list[int] = []

    def measure_progress(step: int, state: Callable[[], Any], counts: Any = None) -> None:
        progress.append(state_bytes(state()))

    with tempfile.TemporaryDirectory(prefix="clbench-plan-") as work:
        ctx = StageContext(model=student, tokenizer=cal.tokenizer, task=task,
                           train_examples=examples, budget=budget, stage_index=index,
                           stage_name=spec.name, seed=cal.run.seed, device=cal.dist.device,
                           work_dir=Path(work), dist=cal.dist, save_progress=measure_progress,
                           generation=cal.run.model.generation, addons=addons)
        report = method.train_stage(ctx)
    # the second step: the first also pays the stage's setup (a teacher's copy, the optimizer)
    seconds = float(report.steps[-1]["seconds"])
    sizes = (state_bytes(method.state_dict()) + sum(state_bytes(a.state_dict()) for a in addons),
             max(progress, default=0))
    del student, method, addons
    return StageCost(spec.name, spec.budget.steps, seconds), sizes


def _diagnostics_seconds(cal: Calibration, plans: Sequence[ColumnPlan], stages: int) -> float:
    """The drift diagnostics of `stages` stages (see the module docstring)."""
    from clbench.metrics.drift import DriftSettings, profile, weight_matrices
    from clbench.run.response_drift import kl_sum
    from clbench.train.rollout import encode_chat

    spec = cal.run.suite.protocol.diagnostics
    seconds = 0.0
    if spec.weight_drift.enabled and stages:
        cal.on_step("parameter drift")
        settings = DriftSettings(k=spec.weight_drift.k)
        started = time.perf_counter()
        for w in weight_matrices(cal.model.named_parameters()).values():
            profile(w.detach().to("cpu"), settings)
        seconds += (time.perf_counter() - started) * (3 + 2 * (stages - 1))
    if spec.response_drift.enabled and stages:
        prompts = [encode_chat(cal.tokenizer, e.messages) for plan in plans
                   if plan.task is not None
                   for e in plan.examples[:spec.response_drift.items_per_column]]
        if prompts:
            cal.on_step("response drift")
            filler = cal.tokenizer.eos_token_id or 0
            responses = [[filler] * cal.run.suite.protocol.decoding.max_new_tokens] * len(prompts)
            started = time.perf_counter()
            with cal.dist.autocast():
                kl_sum(cal.model, lambda: cal.model, prompts, responses)
            # both models on the first stage, the current one alone on later ones (the base
            # side is kept: clbench.run.response_drift.BaseScores)
            seconds += (time.perf_counter() - started) * (stages + 1) / 2
    return seconds


def _weights_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())
