"""The method contract: what a training method plugin receives for a stage and what it returns.

A method is a class registered in the `clbench.methods` entry-point group. It has a documented
pydantic config (`Config`), trains the model in place on one stage under the stage's budget, and
returns a :class:`StageReport`. The protocol owns everything around it (loading, evaluation,
checkpoints), so methods differ only in their objective and teacher.

A method that can continue a stage from its middle offers its progress after each optimizer step
through ``ctx.save_progress``; when a checkpoint is due, the protocol saves it with the student's
weights, the method's ``state_dict()`` and the RNG states, and a run stopped later in the stage
trains it again with ``ctx.resume`` set to that progress (weights, method state and RNGs already
restored). A method that never calls ``save_progress`` simply restarts an interrupted stage.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # heavy imports only for type checkers
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from clbench.spec.schema import Budget
    from clbench.tasks.base import Example, TaskSource
    from clbench.train.distributed import Distributed
    from clbench.train.loop import StepHooks, TrainingHooks


#: The metadata key of a training item naming the stage it was drawn for.
STAGE_KEY = "clbench.stage"

class MethodConfig(BaseModel):
    """Base of every method's config. Fields must carry descriptions (they are the CLI help)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


@dataclass
class StageContext:
    """Everything a method needs to train one stage.

    `model` is the plain student: generate, copy teachers and score without gradient with it.
    Training forwards go through `train_model`, the same weights prepared by `dist` (DDP-wrapped
    when several processes train), so that their gradients are averaged over the processes;
    `dist` also has rank, barriers, the sharding of a step's prompts and the autocast context.
    Both default to a single process training `model` as stored (no autocast).

    `train_examples` carry the name of the stage they were drawn for in their metadata
    (:data:`STAGE_KEY`), so an item kept from an earlier stage (replay) is graded by its own
    task: :meth:`task_for` routes it through `tasks`, every stream stage's task by name.
    `addons` are the run's continual-learning add-ons, which the :class:`TrainingLoop` calls
    at every point after the method's own hooks.
    """

    model: PreTrainedModel                 # the student, trained in place
    tokenizer: PreTrainedTokenizerBase
    task: TaskSource                       # the stage's task: grader, answer start, token cap
    train_examples: list[Example]          # the stage's training items, in data order
    budget: Budget
    stage_index: int                       # 1-based position in the stream
    stage_name: str
    seed: int                              # run seed (already mixed with the stage index)
    device: torch.device
    work_dir: Path                         # scratch space for this stage inside the run dir
    log_step: Callable[[dict[str, Any]], None] = lambda record: None  # per-step metrics sink
    dist: Distributed | None = None        # the run's accelerator (one process when not given)
    train_model: torch.nn.Module | None = None  # `model` prepared by `dist` for training
    # After optimizer step `step` (0-based) is complete and logged, every process calls
    # `save_progress(step, state, counts)`: `state()` returns what continuing after that step
    # needs besides the weights, the method's state_dict() and the RNGs (optimizer, schedule,
    # report so far, ...) and is called on the main process only, when a checkpoint is due
    # (on every process when the student is sharded: gathering the optimizer's shards, with
    # `dist.optimizer_state`, is a collective);
    # `counts` (this process's counters) are summed over the processes into its "counters".
    save_progress: Callable[..., None] = lambda step, state, counts=None: None
    # The `state()` of the last saved step when the stage continues after a stop (it holds that
    # `step` too), else None. A method must continue from it (`restore_loop` empties it; a
    # stage given back and left untouched is an error).
    resume: dict[str, Any] | None = None
    generation: str = "loop"               # the generator's engine (`ModelSpec.generation`)
    nonfinite_loss: str = "stop"           # a NaN/inf step: `stop` or `skip` (the protocol's)
    tasks: Mapping[str, TaskSource] = field(default_factory=dict)  # stream tasks by stage name
    addons: Sequence[TrainingHooks] = ()   # the run's add-ons, in the order they compose
    addons_applied: bool = False           # set by the TrainingLoop that called them

    def __post_init__(self) -> None:
        if self.dist is None:
            from clbench.train.distributed import Distributed

            self.dist = Distributed.for_model(self.model, self.device)
        if self.train_model is None:
            self.train_model = self.dist.prepare_student(self.model)

    def task_for(self, example: Example) -> TaskSource:
        """The task that grades `example`: that of the stage it was drawn for (an item of an
        earlier stage, replayed), else the stage's own."""
        stage = example.metadata.get(STAGE_KEY)
        return self.tasks.get(stage, self.task) if isinstance(stage, str) else self.task



@dataclass
class StageReport:
    """What a method reports after a stage. Every method fills the counters and timings."""

    steps: list[dict[str, Any]] = field(default_factory=list)   # one record per optimizer step
    counters: dict[str, int] = field(default_factory=dict)      # generated/trained/teacher tokens
    wall_time: dict[str, float] = field(default_factory=dict)   # seconds per phase
    extra: dict[str, Any] = field(default_factory=dict)         # method-specific summaries

    def summary(self) -> dict[str, float]:
        """Mean of every numeric per-step field over the stage."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for rec in self.steps:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    sums[k] = sums.get(k, 0.0) + float(v)
                    counts[k] = counts.get(k, 0) + 1
        return {k: sums[k] / counts[k] for k in sums}


class Method(ABC):
    """A training method plugin."""

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    #: Whether the method trains correctly when the student is sharded (FSDP2): every forward
    #: whose gradient counts goes through `ctx.train_model`, the same number of them on every
    #: process, and nothing writes `ctx.model`'s weights (under sharding it is a plain copy
    #: that the training loop refreshes after each optimizer step). A sharded launch refuses
    #: a method whose own class does not set it (a subclass is not trusted with its parent's).
    supports_sharding: ClassVar[bool] = False

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None) -> None:
        if not isinstance(config, MethodConfig):
            config = self.Config.model_validate(config or {})
        self.config = config

    def hooks(self, ctx: StageContext) -> StepHooks:
        """The method's step logic for one stage, run by the shared training loop (which
        :meth:`train_stage` does by default). A method implements this or `train_stage`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither hooks(ctx) nor "
                                  "train_stage(ctx)")

    def train_stage(self, ctx: StageContext) -> StageReport:
        """Train `ctx.model` in place on one stage and report what happened: by default the
        shared :class:`~clbench.train.loop.TrainingLoop` with :meth:`hooks` (and the run's
        add-ons). A method that overrides it trains without add-ons: a run that has some
        refuses it."""
        from clbench.train.loop import TrainingLoop

        return TrainingLoop(ctx, self.config, self.hooks(ctx)).run()  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """State kept across stages (e.g. a teacher that outlives a stage); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (used when resuming a run)."""
