"""SFT: supervised fine-tuning on the reference solutions of the stage's training items.

Each optimizer step takes `prompts_per_step` items (the same item order as the on-policy methods),
and minimises the mean negative log-likelihood of the reference response tokens, followed by the
EOS token, given the chat prompt (loss on the assistant response only; the prompt is context).
Same number of optimizer steps and prompts per step as the on-policy methods, so budgets compare.
With several processes each rank trains on its share of the step's items (as the on-policy loop
does) and divides its summed token loss by the step's response tokens over all ranks, divided by
the number of ranks; DDP averages the ranks' gradients, so the step is the one-process step (the
token mean over all the step's items) however the tokens fall on the ranks.
The reference code of the paper has no SFT baseline: this one is new to clbench.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from clbench.api import (
    Example,
    Method,
    OptimizerSettings,
    StageContext,
    StepBatch,
    StepHooks,
    TrainingLoop,
    completion_logprobs,
    encode_reference,
)


class SFTConfig(OptimizerSettings):
    """SFT settings."""

    lr: float = Field(default=1e-5, gt=0.0, description="Peak learning rate (default 1e-5, the "
                      "paper's SDPO rate: a common full fine-tuning rate for small models; GRPO's "
                      "1e-6 barely moves a model with a dense NLL loss). A stage budget's `lr` "
                      "overrides it.")
    micro_batch_size: int | None = Field(default=None, ge=1, description="Examples per forward/"
                                         "backward pass (gradient accumulation); all at once "
                                         "when unset.")
    append_eos: bool = Field(default=True, description="Train on the EOS token after each "
                             "reference so the model learns to stop.")


@dataclass
class ReferenceBatch(StepBatch):
    """One step's items as (prompt ids, reference response ids) pairs."""

    pairs: list[tuple[list[int], list[int]]]


class SFT(Method):
    """Supervised fine-tuning on reference solutions."""

    name: ClassVar[str] = "sft"
    supports_sharding: ClassVar[bool] = True
    description: ClassVar[str] = ("SFT: next-token loss on the reference solutions (response "
                                  "tokens only), same steps and prompts per step as on-policy")
    Config: ClassVar[type[SFTConfig]] = SFTConfig
    config: SFTConfig

    def hooks(self, ctx: StageContext) -> SFTHooks:
        return SFTHooks(self.config, ctx)


class SFTHooks(StepHooks):
    """SFT's part of the training loop: a step's items with their references, the NLL loss."""

    def __init__(self, config: SFTConfig, ctx: StageContext) -> None:
        self.config = config
        self.ctx = ctx

    def encode(self, example: Example) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of one training item."""
        return encode_reference(self.ctx.tokenizer, example, self.config.append_eos)

    def build_batch(self, loop: TrainingLoop, step: int, examples: list[Example]
                    ) -> tuple[StepBatch, dict[str, float]]:
        loop.counters.add("prompts", len(examples))
        return ReferenceBatch(pairs=[self.encode(e) for e in examples]), {}

    def supervised_tokens(self, batch: StepBatch) -> int:
        assert isinstance(batch, ReferenceBatch)
        return sum(len(response) for _, response in batch.pairs)

    def micro_batches(self, batch: StepBatch) -> list[Any]:
        assert isinstance(batch, ReferenceBatch)
        size = self.config.micro_batch_size or len(batch.pairs)
        return [batch.pairs[s:s + size] for s in range(0, len(batch.pairs), size)]

    def part_sequences(self, batch: StepBatch, part: Any
                       ) -> tuple[list[list[int]], list[list[int]]]:
        return [p for p, _ in part], [r for _, r in part]

    def loss(self, loop: TrainingLoop, batch: StepBatch, part: Any) -> tuple[Any, dict[str, float]]:
        prompts, responses = self.part_sequences(batch, part)
        scored = completion_logprobs(loop.train_model, prompts, responses, grad=True)
        return -batch.token_mean(scored.logprobs, scored.mask), {}

    def step_stats(self, batch: StepBatch) -> dict[str, float]:
        assert isinstance(batch, ReferenceBatch)
        return {"supervised_token_fraction": 1.0,
                "response_tokens_mean": self.supervised_tokens(batch) / len(batch.pairs)}
