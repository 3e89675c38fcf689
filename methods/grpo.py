"""GRPO: group-relative policy optimisation, as the paper's reference baseline runs it.

Per prompt, n rollouts are graded; each rollout's advantage is r - mean(group) (Dr.GRPO style; std
normalisation optional). Every completion token gets the clipped surrogate
-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) with rho = p_new / p_old (dual clip optional),
plus, when beta > 0, beta times the k3 estimate of KL to the model as it was at the stage's start.
The loss is a token mean over the step's completion tokens (over every rank's, with several
processes). Loss math: the API's loss helpers; plumbing: its
:class:`~clbench.api.Objective`.
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
    clipped_surrogate,
    frozen_copy,
    group_advantages,
    kl_to_reference,
    module_state,
)


class GRPOConfig(OnPolicySettings):
    """GRPO settings. Defaults follow the paper's reference baseline."""

    lr: float = Field(default=1e-6, gt=0.0, description="Peak learning rate (reference: 1e-6; "
                      "its sweeps go to 1e-5). A stage budget's `lr` overrides it.")
    scale_rewards: bool = Field(default=False, description="Divide advantages by the group's "
                                "reward std (original GRPO); off as in the reference (Dr.GRPO).")
    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="Lower clip range of the "
                           "probability ratio: rho >= 1 - eps_low.")
    eps_high: float = Field(default=0.28, ge=0.0, description="Upper clip range of the "
                            "probability ratio: rho <= 1 + eps_high (clip-higher).")
    dual_clip: float | None = Field(default=None, gt=1.0, description="Dual-clip constant c: "
                                    "caps the loss of negative-advantage tokens at -c A "
                                    "(reference: 3.0; matters only with inner_updates > 1).")
    beta: float = Field(default=0.0, ge=0.0, description="Weight of the KL penalty to the model "
                        "as it was at the start of the stage (k3 estimator); 0 disables it and "
                        "skips the reference model.")


class GRPOObjective(Objective):
    """Clipped surrogate on group-relative advantages, optional KL to the stage's start model."""

    config: GRPOConfig
    resumable = True

    def __init__(self, ctx: StageContext, config: GRPOConfig, **kwargs: Any) -> None:
        super().__init__(ctx, config, **kwargs)
        self.reference: torch.nn.Module | None = None

    def on_stage_start(self, loop: TrainingLoop) -> None:
        if self.config.beta > 0:
            self.reference = frozen_copy(loop.model)

    def state_dict(self) -> dict[str, Any]:
        """The KL reference (the model at the start of the stage), when there is one."""
        if self.reference is None:
            return {}
        return {"reference": module_state(self.reference)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.reference is not None:  # on_stage_start copied the resumed student: replace it
            self.reference.load_state_dict(state["reference"])

    def prepare(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        advantages = group_advantages(batch.rewards, batch.group_size,
                                      scale_std=self.config.scale_rewards)
        batch.extra["advantages"] = advantages
        if self.reference is not None:
            parts = [batch.score(self.reference, rows, grad=False,
                                 chunk_size=self.chunk_size).logprobs
                     for rows in self.micro_batches(batch)]
            batch.extra["ref_logprobs"] = torch.cat(parts)
        with_signal = (advantages != 0).float().unsqueeze(1) * batch.completion_mask
        total = max(int(batch.completion_mask.sum()), 1)
        return {"supervised_token_fraction": float(with_signal.sum()) / total,
                "advantage_abs_mean": float(advantages.abs().mean())}

    def loss(self, loop: TrainingLoop, batch: StepBatch, rows: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        assert isinstance(batch, RolloutBatch)
        cfg = self.config
        current = batch.score(loop.train_model, rows, grad=True, chunk_size=self.chunk_size)
        mask = current.mask
        old = batch.old_or_detached(rows, current.logprobs)
        adv = batch.extra["advantages"][rows.start:rows.stop]
        per_token = clipped_surrogate(current.logprobs, old, adv, mask, eps_low=cfg.eps_low,
                                      eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)
        # rollouts from another engine: reweighted before the KL term, as TRL does
        per_token = batch.corrected(per_token, rows)
        stats: dict[str, float] = {}
        if self.reference is not None:
            ref = batch.extra["ref_logprobs"][rows.start:rows.stop]
            kl = kl_to_reference(current.logprobs, ref) * mask
            per_token = per_token + cfg.beta * kl
            stats["kl_to_start"] = float(batch.token_mean(kl.detach(), mask))
        ratio = torch.exp((current.logprobs.detach() - old).clamp(-20, 20))
        clipped = ((ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)) & mask
        stats["clip_fraction"] = batch.token_share(float(clipped.sum()))
        # a token mean over the step's completion tokens, every rank's (`supervised_tokens`)
        return batch.token_mean(per_token, mask), stats

    def supervised_tokens(self, batch: StepBatch) -> int:
        assert isinstance(batch, RolloutBatch)
        return int(batch.completion_mask.sum())


class GRPO(Method):
    """Group-relative policy optimisation with a clipped surrogate (the paper's baseline)."""

    name: ClassVar[str] = "grpo"
    supports_sharding: ClassVar[bool] = True
    description: ClassVar[str] = ("GRPO: group-relative advantages r - mean(group), clipped "
                                  "surrogate 0.2/0.28, optional KL to the stage's start model")
    Config: ClassVar[type[GRPOConfig]] = GRPOConfig
    config: GRPOConfig

    def hooks(self, ctx: StageContext) -> GRPOObjective:
        return GRPOObjective(ctx, self.config)
