"""Rejection-sampling fine-tuning (RFT): sample, keep what the verifier accepts, learn it.

Each step samples `samples_per_prompt` rollouts of each prompt, grades them, and minimises the
negative log-likelihood of the accepted ones (reward at least `threshold`): a token mean over
their tokens. A step with no accepted rollout trains nothing. This is the method of rejection
sampling fine-tuning (Yuan et al. 2023), STaR's inner step (Zelikman et al. 2022) and ReST's
improve step (Gulcehre et al. 2023), with one round of sampling per optimizer step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from clbench.api import (
    Method,
    Objective,
    OnPolicySettings,
    RolloutBatch,
    StageContext,
    StepBatch,
    TrainingLoop,
)


class RFTConfig(OnPolicySettings):
    """RFT settings: the on-policy ones (optimizer, batches) and which rollouts are kept."""

    lr: float = Field(default=1e-5, gt=0.0, description="Peak learning rate (SFT's). A stage "
                      "budget's `lr` overrides it.")
    threshold: float = Field(default=1.0, ge=0.0, le=1.0, description="A rollout with at least "
                             "this reward is kept and learned from (1: correct ones only).")


class RFTObjective(Objective):
    """The NLL of the accepted rollouts of each batch."""

    config: RFTConfig
    resumable = True  # it keeps nothing between steps

    def prepare(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        kept = batch.rewards >= self.config.threshold
        batch.extra["kept"] = batch.completion_mask & kept[:, None]
        return {"kept_fraction": float(kept.float().mean())}

    def supervised_tokens(self, batch: StepBatch) -> int:
        assert isinstance(batch, RolloutBatch)
        return int(batch.extra["kept"].sum())

    def loss(self, loop: TrainingLoop, batch: StepBatch, rows: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        assert isinstance(batch, RolloutBatch)
        kept = batch.extra["kept"][rows.start:rows.stop]
        if not bool(kept.any()):  # nothing accepted in these rows: no forward, no graph
            return torch.zeros(()), {}
        scored = batch.score(loop.train_model, rows, grad=True, chunk_size=self.chunk_size)
        return batch.token_mean(-scored.logprobs, kept), {}


class RFT(Method):
    """Rejection-sampling fine-tuning on the method's own accepted rollouts."""

    name: ClassVar[str] = "rft"
    description: ClassVar[str] = ("RFT: NLL on the sampled rollouts the verifier accepts "
                                  "(rejection-sampling fine-tuning)")
    Config: ClassVar[type[RFTConfig]] = RFTConfig
    supports_sharding: ClassVar[bool] = True
    config: RFTConfig

    def hooks(self, ctx: StageContext) -> RFTObjective:
        return RFTObjective(ctx, self.config)
