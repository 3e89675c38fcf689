"""Learning without forgetting: distillation from the model as it was at the stage's start
(Li & Hoiem 2016, "Learning without Forgetting"), on the step's own sequences.

At the start of each stage the add-on keeps a frozen copy of the student. Every micro-batch then
adds `weight` times the mean over its completion tokens (over the step's, on every process) of

    KL( p_start(. | context) / T  ||  p_student(. | context) / T )

the divergence of the student's next-token distribution from the stage-start model's, both
softened by the temperature T, at every position of the completions the method trains on (SFT:
the reference solutions; an on-policy method: its rollouts). Defaults follow Avalanche's LwF
(alpha 1, temperature 2, forward KL, no T^2 factor). With `topk` the divergence is taken over
the stage-start model's k likeliest tokens plus one bucket for the rest of the vocabulary (the
SDPO reference's support), which bounds memory on large vocabularies.
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
    completion_distributions,
    frozen_copy,
    generalized_jsd,
    module_state,
    topk_logprob_divergence,
)


class LwFConfig(AddOnConfig):
    """The distillation term's weight, temperature and support."""

    weight: float = Field(default=1.0, ge=0.0, description="Weight of the distillation term "
                          "(Avalanche's alpha; 0: none).")
    temperature: float = Field(default=2.0, gt=0.0, description="Softmax temperature T of both "
                               "distributions (Li & Hoiem and Avalanche: 2).")
    topk: int | None = Field(default=None, ge=1, description="Take the divergence over the "
                             "stage-start model's k likeliest tokens plus a tail bucket; null: "
                             "the whole vocabulary.")


class LwF(AddOn):
    """Keep the student's predictions on the current data near the stage-start model's."""

    name: ClassVar[str] = "lwf"
    description: ClassVar[str] = ("LwF: KL from the stage-start model to the student on the "
                                  "step's own sequences, added to the method's loss")
    Config: ClassVar[type[LwFConfig]] = LwFConfig
    config: LwFConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.start: torch.nn.Module | None = None  # the student at the stage's start
        self._batch: StepBatch | None = None
        self._tokens = 0  # the completion tokens of that batch, over every process

    def on_stage_start(self, loop: TrainingLoop) -> None:
        self.start = frozen_copy(loop.model)

    def loss_term(self, loop: TrainingLoop, batch: StepBatch, part: Any
                  ) -> tuple[torch.Tensor | None, dict[str, float]]:
        if self.config.weight == 0 or self.start is None:
            return None, {}
        hooks, cfg = loop.hooks, self.config
        if batch is not self._batch:  # a new batch: its token count, once, on every process
            self._batch = batch
            self._tokens = loop.dist.sum_int(sum(
                len(c) for p in hooks.micro_batches(batch)
                for c in hooks.part_sequences(batch, p)[1]))
        prompts, completions = hooks.part_sequences(batch, part)
        common = {"temperature": cfg.temperature}
        with torch.no_grad():
            start = completion_distributions(self.start, prompts, completions, topk=cfg.topk,
                                             **common)
        student = completion_distributions(loop.train_model, prompts, completions,
                                           indices=start.indices, grad=True, **common)
        if cfg.topk is None:
            per_token = generalized_jsd(student.logprobs, start.logprobs, alpha=0.0)
        else:
            per_token = topk_logprob_divergence(student.logprobs, start.logprobs, alpha=0.0)
        mask = student.mask
        kl = (per_token * mask).sum() / max(self._tokens, 1) * loop.dist.num_processes
        return cfg.weight * kl, {"lwf_kl": float(kl.detach())}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        self.start = self._batch = None  # the next stage starts from its own weights

    def state_dict(self) -> dict[str, Any]:
        if self.start is None:
            return {}
        return {"start": module_state(self.start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.start is not None and "start" in state:  # a stage continued after a stop
            self.start.load_state_dict(state["start"])
