"""Weight interpolation after each stage (WiSE-FT: Wortsman et al. 2022, "Robust fine-tuning of
zero-shot models"; applied stage by stage as in model-merging approaches to continual learning).

At the end of every stage the weights become

    theta <- (1 - alpha) * theta_start + alpha * theta_end

with theta_start the weights the stage started from (the base model's for the first stage, the
previous stage's merged ones after) and theta_end those the method trained. alpha = 1 keeps the
trained weights; WiSE-FT's default is 0.5. The merged weights are the stage's: they are
evaluated, checkpointed and trained on by the next stage.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from clbench.api import AddOn, AddOnConfig, StageReport, TrainingLoop, parameter_snapshot


class MergeConfig(AddOnConfig):
    """The interpolation weight."""

    alpha: float = Field(default=0.5, ge=0.0, le=1.0, description="Weight of the stage's trained "
                         "weights in the merge (1: no merge, 0: undo the stage); WiSE-FT: 0.5.")


class Merge(AddOn):
    """Interpolate each stage's trained weights with those it started from."""

    name: ClassVar[str] = "merge"
    description: ClassVar[str] = ("Merge: after each stage, the weights interpolated with the "
                                  "stage's starting weights (WiSE-FT, alpha 0.5)")
    Config: ClassVar[type[MergeConfig]] = MergeConfig
    config: MergeConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.start: dict[str, torch.Tensor] = {}  # parameter name -> weights at stage start

    def on_stage_start(self, loop: TrainingLoop) -> None:
        self.start = parameter_snapshot(loop.model)

    @torch.no_grad()
    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        alpha = self.config.alpha
        for name, p in loop.model.named_parameters():
            p.lerp_(self.start[name].to(p.dtype), 1.0 - alpha)  # p + (1-alpha) (start - p)
        self.start = {}
        report.extra["merge"] = {"alpha": alpha}

    def state_dict(self) -> dict[str, Any]:
        return {"start": dict(self.start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["start"]:  # a stage continued after a stop
            self.start = dict(state["start"])
