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

import time
from typing import Any, ClassVar

from pydantic import Field

from clbench.tasks.base import continuation
from clbench.train.api import Method, StageContext, StageReport
from clbench.train.logprobs import completion_logprobs
from clbench.train.losses import token_mean
from clbench.train.optim import (
    Counters,
    OptimizerSettings,
    PhaseClock,
    build_optimizer,
    build_scheduler,
    loop_state,
    optimizer_step,
    restore_loop,
    set_gradient_checkpointing,
    stage_lr,
    step_examples,
)
from clbench.train.rollout import encode_chat


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


class SFT(Method):
    """Supervised fine-tuning on reference solutions."""

    name: ClassVar[str] = "sft"
    description: ClassVar[str] = ("SFT: next-token loss on the reference solutions (response "
                                  "tokens only), same steps and prompts per step as on-policy")
    Config: ClassVar[type[SFTConfig]] = SFTConfig
    config: SFTConfig

    def encode(self, ctx: StageContext, example: Any) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of one training item."""
        tokenizer = ctx.tokenizer
        prompt = encode_chat(tokenizer, example.messages)
        # the reference after the start of the response its prompt already holds (if any)
        response = list(tokenizer(continuation(example), add_special_tokens=False)["input_ids"])
        if self.config.append_eos and tokenizer.eos_token_id is not None:
            response.append(int(tokenizer.eos_token_id))
        return prompt, response

    def train_stage(self, ctx: StageContext) -> StageReport:
        with ctx.dist.autocast():
            return self._train(ctx)

    def _train(self, ctx: StageContext) -> StageReport:
        cfg, budget, model, dist = self.config, ctx.budget, ctx.model, ctx.dist
        lr = stage_lr(cfg, budget)
        set_gradient_checkpointing(model, cfg)
        optimizer = dist.prepare_optimizer(build_optimizer(model, cfg, lr))
        scheduler = build_scheduler(optimizer, cfg, budget.steps)
        clock, counters, report = PhaseClock(), Counters(), StageReport()
        start = 0
        if ctx.resume is not None:  # continuing the stage after a stop
            start = restore_loop(ctx.resume, dist, optimizer, scheduler, clock, counters,
                                 report.steps)
        for step in range(start, budget.steps):
            started = time.perf_counter()
            examples = step_examples(ctx.train_examples, budget.prompts_per_step, step, ctx.seed,
                                     rank=dist.process_index, world=dist.num_processes,
                                     stage=ctx.stage_name)
            pairs = [self.encode(ctx, e) for e in examples]
            normalizer = sum(len(r) for _, r in pairs)
            # the step's response tokens, every rank's; rank losses are scaled by `world` since
            # DDP averages gradients (see the module docstring)
            all_tokens, world = dist.sum_int(normalizer), dist.num_processes
            size = cfg.micro_batch_size or len(pairs)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            starts = range(0, len(pairs), size)
            with clock.phase("backward"):
                for s in starts:
                    part = pairs[s:s + size]
                    # Only the last micro-batch all-reduces gradients (several processes).
                    with dist.no_sync(ctx.train_model, sync=s == starts[-1]):
                        scored = completion_logprobs(ctx.train_model, [p for p, _ in part],
                                                     [r for _, r in part], grad=True)
                        loss = -token_mean(scored.logprobs, scored.mask, all_tokens)
                        if world > 1:
                            loss = loss * world
                        dist.backward(loss)
                    total += float(loss.detach())
            with clock.phase("step"):
                grad_norm, current_lr = optimizer_step(model, optimizer, scheduler,
                                                       cfg.max_grad_norm)
            model.eval()
            counters.add("trained_tokens", normalizer)
            counters.add("prompts", len(pairs))
            counters.add("optimizer_steps", 1)
            record = {"step": step + 1, "loss": total, "grad_norm": grad_norm, "lr": current_lr,
                      "supervised_token_fraction": 1.0,
                      "response_tokens_mean": normalizer / len(pairs),
                      "seconds": time.perf_counter() - started}
            record = dist.mean_record(record)
            report.steps.append(record)
            ctx.log_step(record)
            ctx.save_progress(step, lambda step=step: loop_state(
                step, optimizer, scheduler, clock, report.steps), counters.values)
        report.counters = dist.sum_counts(counters.values)
        report.wall_time = clock.snapshot()
        report.extra["lr"] = lr
        return report
