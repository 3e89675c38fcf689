"""L2-SP: an L2 penalty towards the weights each stage starts from (Li, Grandvalet and Davoine
2018, "Explicit Inductive Bias for Transfer Learning with Convolutional Networks").

Every micro-batch adds its share of `strength / 2 * ||theta - theta_start||^2` to whatever loss
the method makes, theta_start being the weights at the start of the stage, so that the step
counts it once. It composes with any method that trains on clbench's loop.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from clbench.api import AddOn, AddOnConfig, StepBatch, TrainingLoop, parameter_snapshot


class L2SPConfig(AddOnConfig):
    """The penalty's strength."""

    strength: float = Field(default=0.01, ge=0.0, description="alpha, the weight of the "
                            "squared distance to the stage-start weights (0: none).")


class L2SP(AddOn):
    """Keep the weights near those the stage started from."""

    name: ClassVar[str] = "l2sp"
    description: ClassVar[str] = "L2-SP: an L2 penalty towards the stage-start weights"
    Config: ClassVar[type[L2SPConfig]] = L2SPConfig
    config: L2SPConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.start: dict[str, torch.Tensor] = {}

    def on_stage_start(self, loop: TrainingLoop) -> None:
        self.start = parameter_snapshot(loop.model, trainable_only=True)

    def loss_term(self, loop: TrainingLoop, batch: StepBatch, part: Any
                  ) -> tuple[torch.Tensor | None, dict[str, float]]:
        if self.config.strength == 0:
            return None, {}
        distance = torch.stack([(p - self.start[name]).pow(2).sum()
                                for name, p in loop.model.named_parameters()
                                if name in self.start]).sum()
        share = 0.5 * self.config.strength * distance / len(loop.hooks.micro_batches(batch))
        return share, {"l2sp_penalty": float(share.detach())}

    def state_dict(self) -> dict[str, Any]:
        return {"start": dict(self.start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = dict(state["start"])
