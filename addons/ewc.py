"""Elastic weight consolidation: a penalty that keeps weights important to earlier stages near
their values after those stages (Kirkpatrick et al. 2017, "Overcoming catastrophic forgetting in
neural networks"; the online form of Schwarz et al. 2018, "Progress & Compress").

At the end of each stage the add-on estimates the diagonal of the Fisher information of the
stage's task, F_i = E[(d log p(reference | prompt) / d theta_i)^2] over `fisher_items` of its
training items (the empirical Fisher of the reference solutions, one item per gradient, whatever
the method trained on), adds it to `decay` times the Fisher of the stages before, and anchors the
weights theta* as they are then. Every micro-batch of a later step adds its share of

    strength / 2 * sum_i F_i * (theta_i - theta*_i)^2

to the method's loss, so the step counts it once. The Fisher and the anchor (two copies of the
trainable weights) are the add-on's state and are checkpointed with it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from clbench.api import (
    AddOn,
    AddOnConfig,
    StageReport,
    StepBatch,
    TrainingLoop,
    completion_logprobs,
    encode_reference,
    parameter_snapshot,
)


class EWCConfig(AddOnConfig):
    """The penalty's strength and how the Fisher is estimated and accumulated."""

    strength: float = Field(default=100.0, ge=0.0, description="lambda, the weight of the "
                            "penalty (0: none).")
    fisher_items: int = Field(default=16, ge=1, description="Training items of a stage whose "
                              "reference solutions estimate its diagonal Fisher at its end.")
    decay: float = Field(default=1.0, ge=0.0, le=1.0, description="Online EWC's gamma: the "
                         "Fisher of earlier stages is multiplied by it before a stage's is "
                         "added (1: summed, as separate penalties per stage would).")


class EWC(AddOn):
    """A Fisher-weighted quadratic penalty towards the weights after each earlier stage."""

    name: ClassVar[str] = "ewc"
    description: ClassVar[str] = ("EWC: a Fisher-weighted penalty keeping weights important to "
                                  "earlier stages near their values after them")
    Config: ClassVar[type[EWCConfig]] = EWCConfig
    config: EWCConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.fisher: dict[str, torch.Tensor] = {}  # parameter name -> running diagonal Fisher
        self.anchor: dict[str, torch.Tensor] = {}  # parameter name -> weights after last stage

    def penalty(self, model: torch.nn.Module) -> torch.Tensor:
        """strength / 2 * sum F (theta - theta*)^2 over the anchored parameters."""
        terms = [(self.fisher[name] * (p - self.anchor[name]).pow(2)).sum()
                 for name, p in model.named_parameters() if name in self.anchor]
        return 0.5 * self.config.strength * torch.stack(terms).sum()

    def loss_term(self, loop: TrainingLoop, batch: StepBatch, part: Any
                  ) -> tuple[torch.Tensor | None, dict[str, float]]:
        if not self.anchor or self.config.strength == 0:
            return None, {}
        # the plain student's parameters are the trained ones (DDP shares them); the penalty is
        # the same on every process, so averaging the gradients keeps it
        share = self.penalty(loop.model) / len(loop.hooks.micro_batches(batch))
        return share, {"ewc_penalty": float(share.detach())}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        ctx, model = loop.ctx, loop.model
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        fisher = {name: torch.zeros_like(p) for name, p in params.items()}
        items = ctx.train_examples[:self.config.fisher_items]
        model.eval()
        for example in items:
            prompt, response = encode_reference(ctx.tokenizer, example)
            logp = completion_logprobs(model, [prompt], [response], grad=True).logprobs.sum()
            grads = torch.autograd.grad(logp, list(params.values()), allow_unused=True)
            for name, grad in zip(params, grads):
                if grad is not None:
                    fisher[name] += grad.detach().float().pow(2) / len(items)
        for name, f in fisher.items():
            earlier = self.fisher.get(name)
            self.fisher[name] = f if earlier is None else self.config.decay * earlier + f
        self.anchor = parameter_snapshot(model, trainable_only=True)
        report.extra["ewc"] = {"fisher_items": len(items), "anchored_parameters": len(params),
                               "fisher_mean": float(sum(f.sum() for f in self.fisher.values())
                                                    / sum(f.numel() for f in self.fisher.values()))}

    def state_dict(self) -> dict[str, Any]:
        return {"fisher": dict(self.fisher), "anchor": dict(self.anchor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fisher = dict(state["fisher"])
        self.anchor = dict(state["anchor"])
