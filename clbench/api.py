"""What a plugin imports from clbench: the names third-party methods and task sources build on.

A method is a :class:`Method` with a documented :class:`MethodConfig` (inherit
:class:`OptimizerSettings` for the optimizer's fields) whose `train_stage(ctx)` trains
`ctx.model` in place and returns a :class:`StageReport`. Most methods run the shared
:class:`TrainingLoop` and say what a step learns from through :class:`StepHooks`; on-policy
methods give an :class:`Objective` to :class:`OnPolicyMethod` instead. A task source is a
:class:`TaskSource` that yields :class:`Example` items and grades completions into a
:class:`Grade`. `docs/plugins.md` walks through a complete plugin.

Names here keep their meaning across minor versions; everything else in clbench may move.
"""

from __future__ import annotations

from clbench.tasks.base import Example, Grade, TaskParams, TaskSource
from clbench.train.api import Method, MethodConfig, StageContext, StageReport
from clbench.train.loop import StepBatch, StepHooks, TrainingLoop
from clbench.train.onpolicy import (
    Objective,
    OnPolicyMethod,
    OnPolicySettings,
    OnPolicyTrainer,
    RolloutBatch,
)
from clbench.train.optim import OptimizerSettings, step_examples

__all__ = [
    "Example", "Grade", "Method", "MethodConfig", "Objective", "OnPolicyMethod",
    "OnPolicySettings", "OnPolicyTrainer", "OptimizerSettings", "RolloutBatch", "StageContext",
    "StageReport", "StepBatch", "StepHooks", "TaskParams", "TaskSource", "TrainingLoop",
    "step_examples",
]
