"""EWC-regularised SFT: SFT with a quadratic penalty that keeps weights important to earlier
stages near their values after those stages (Kirkpatrick et al. 2017, "Overcoming catastrophic
forgetting in neural networks").

After each stage the method estimates the diagonal of the Fisher information of the stage's
task, F_i = E[(d log p(reference | prompt) / d theta_i)^2] over `fisher_items` training items
(the empirical Fisher, one item per backward pass), adds it to the Fisher of the stages before
(the online variant with no decay) and keeps the weights theta* as they are at the stage's end.
Every later optimizer step adds

    ewc_lambda / 2 * sum_i F_i * (theta_i - theta*_i)^2

to SFT's loss. What it holds back is the Fisher-weighted distance sum F (theta - theta*)^2
(under AdamW a weight with little Fisher still moves about lr per step, as under SFT). The
Fisher and the anchor weights are the method's state: they outlive a stage
and are checkpointed with it (two copies of the model's trainable weights).

This package is an example of a clbench method plugin: it subclasses the built-in SFT and adds
one hook of the shared training loop (`before_backward`), and registers itself through the
`clbench.methods` entry point in its pyproject.toml.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from clbench.api import StageContext, StageReport, StepBatch, StepHooks, TrainingLoop
from clbench_methods.sft import SFT, SFTConfig, SFTHooks


class EWCConfig(SFTConfig):
    """SFT's settings and the strength of the EWC penalty."""

    ewc_lambda: float = Field(default=100.0, ge=0.0, description="Weight of the EWC penalty "
                              "(lambda); 0 is plain SFT.")
    fisher_items: int = Field(default=16, ge=1, description="Training items of a stage used to "
                              "estimate its diagonal Fisher information at the stage's end.")


class EWCSFT(SFT):
    """SFT with an EWC penalty towards the weights of earlier stages."""

    name: ClassVar[str] = "ewc-sft"
    description: ClassVar[str] = ("EWC: SFT plus a Fisher-weighted quadratic penalty that keeps "
                                  "weights important to earlier stages near their values")
    Config: ClassVar[type[EWCConfig]] = EWCConfig
    config: EWCConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.fisher: dict[str, torch.Tensor] = {}  # parameter name -> summed diagonal Fisher
        self.anchor: dict[str, torch.Tensor] = {}  # parameter name -> weights after last stage

    def hooks(self, ctx: StageContext) -> StepHooks:
        return EWCHooks(self, ctx)

    def penalty(self, model: torch.nn.Module) -> torch.Tensor:
        """lambda / 2 * sum F (theta - theta*)^2 over the anchored parameters (0 before any)."""
        terms = [(self.fisher[name] * (p - self.anchor[name]).pow(2)).sum()
                 for name, p in model.named_parameters() if name in self.anchor]
        if not terms:
            return torch.zeros(())
        return 0.5 * self.config.ewc_lambda * torch.stack(terms).sum()

    def consolidate(self, loop: TrainingLoop, ctx: StageContext) -> None:
        """Add this stage's diagonal Fisher to the running one and anchor the weights here."""
        model = loop.model
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        fisher = {name: torch.zeros_like(p) for name, p in params.items()}
        items = ctx.train_examples[:self.config.fisher_items]
        model.eval()
        for example in items:
            prompt, response = self.encode(ctx, example)
            model.zero_grad(set_to_none=True)
            scored = _logprobs(model, prompt, response)
            (-scored).backward()
            for name, p in params.items():
                if p.grad is not None:
                    fisher[name] += p.grad.detach().float().pow(2) / len(items)
        model.zero_grad(set_to_none=True)
        for name, f in fisher.items():
            self.fisher[name] = self.fisher.get(name, torch.zeros_like(f)) + f
            self.anchor[name] = params[name].detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {"fisher": self.fisher, "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fisher = dict(state.get("fisher", {}))
        self.anchor = dict(state.get("anchor", {}))


def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response | prompt), summed over the response's tokens, with gradient."""
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    targets = ids[0, len(prompt):]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).sum()


class EWCHooks(SFTHooks):
    """SFT's hooks plus the penalty before every backward and the Fisher at the stage's end."""

    method: EWCSFT

    def __init__(self, method: EWCSFT, ctx: StageContext) -> None:
        super().__init__(method, ctx)
        self.last_penalty = 0.0

    def before_backward(self, loop: TrainingLoop, batch: StepBatch, loss: torch.Tensor
                        ) -> torch.Tensor:
        if not self.method.anchor or self.method.config.ewc_lambda == 0:
            return loss
        penalty = self.method.penalty(loop.model)  # the plain student: the anchors' names
        self.last_penalty = float(penalty.detach())
        # once per step: each of the step's micro-batches carries its share
        return loss + penalty / len(self.micro_batches(batch))

    def after_step(self, loop: TrainingLoop, step: int) -> dict[str, float]:
        return {"ewc_penalty": self.last_penalty}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        self.method.consolidate(loop, self.ctx)
        report.extra["ewc_anchored_parameters"] = len(self.method.anchor)
