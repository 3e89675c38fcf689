"""What every on-policy method shares; a method is an objective on it.

The stage runs on the training loop every method shares (:mod:`clbench.train.loop`: optimizer,
schedule, micro-batches, records, checkpoints); an on-policy method's hooks are an
:class:`Objective`, whose base makes the batches and whose subclass gives the loss.
One stage = `budget.steps` optimizer steps. Every `inner_updates` steps a fresh batch is built:
1. the loop picks `prompts_per_step` training items (:func:`clbench.train.optim.step_examples`,
   as the run's add-ons chose them);
2. sample `samples_per_prompt` rollouts of each (:class:`clbench.train.rollout.Generator`),
   each at most `budget.max_new_tokens` long, or its item's tighter cap where the task gives one
   (:meth:`clbench.tasks.base.TaskSource.max_new_tokens_for`: the joint reference's mixture);
3. grade every rollout with its item's task (the stage's, or a replayed item's own stage's)
   -> reward, correct, feedback;
4. score: old log-probs (only when several updates reuse a batch; with one update the ratio is
   exactly 1 and the current log-probs, detached, serve) and the objective's `prepare` (GRPO:
   advantages and reference log-probs; SDPO: teacher contexts and teacher scores);
5. one optimizer step per update: the objective's loss on micro-batches, backward, clip, AdamW.

A subclass of :class:`Objective` sees the batch and returns a loss; everything else (sampling,
grading, counters, per-phase wall time, per-step records, lr schedule) lives here and in the
loop, so methods differ in their objective and teacher, not in plumbing.

Several processes (`ctx.dist`): every rank draws the step's prompts and keeps its own share
(whole prompts with all their samples) and samples with its own seed. The loss stays the token
mean over the whole step: each rank sums its tokens' losses and divides by the step's token count
over ALL ranks divided by the number of ranks (:meth:`RolloutBatch.token_mean`); DDP averages the
ranks' gradients, so N processes take the step one process takes on the same rollouts, however
the tokens fall on the ranks. Micro-batches accumulate without communication; only the last one
all-reduces. Every rank runs the same forwards through the prepared student: a rank whose rows
give no loss runs a zero-weighted one (see :class:`Objective`), and a step without a supervised
token on any rank takes no update on any. Step records are averaged over the ranks (the loss so
becomes the step's token mean), counters summed. Objectives compute training forwards with
`loop.train_model` (the prepared student) and everything without gradient with `loop.model`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from clbench.metrics.artifacts import max_repeat
from clbench.tasks.base import Example, Grade, grade_all
from clbench.train.logprobs import TokenLogprobs, completion_logprobs, pack_batch
from clbench.train.loop import StepBatch, StepHooks, TrainingLoop
from clbench.train.optim import OptimizerSettings, rank_share
from clbench.train.rollout import Generator, HFGenerator, Rollout, SamplingParams
from clbench.train.sampler_correction import SamplerCorrection, sampler_weights

if TYPE_CHECKING:
    from clbench.train.api import StageContext


class OnPolicySettings(OptimizerSettings):
    """Fields every on-policy method shares: how batches are reused, split and stopped."""

    inner_updates: int = Field(default=1, ge=1, description="Optimizer steps per generated "
                               "batch; 1 makes the probability ratio exactly 1 at every update.")
    micro_batch_size: int | None = Field(default=None, ge=1, description="Rollouts per forward/"
                                         "backward pass (gradient accumulation); all at once "
                                         "when unset.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings for the "
                            "training rollouts (EOS always stops).")
    generation_batch_size: int | None = Field(
        default=None, ge=1, description="Rollouts generated at once by each process; its whole "
        "share of the step when unset. Smaller bounds the KV cache of long rollouts (the paper "
        "suite's 8k-token math rollouts: 1.27 GiB each on Qwen3-4B). Each batch draws from "
        "its own seed, so another size draws other samples.")
    sampler_correction: SamplerCorrection = Field(
        default="sequence_mask", description="How rollouts drawn by an engine other than the "
        "trained model (vLLM) are reweighted for the gap between its sampler and the trainer, "
        "by the ratio p_trainer / p_sampler of their tokens (TRL's "
        "vllm_importance_sampling_mode and default): `sequence_mask` drops a completion whose "
        "ratio lies outside [sampler_clip_min, sampler_clip_max], `sequence_truncate` clips it, "
        "`token_mask` / `token_truncate` do so per token, `none` leaves the loss as it is. The "
        "decode loop samples from the trained weights themselves: nothing to correct there.")
    sampler_clip_max: float | None = Field(
        default=3.0, gt=0.0, description="Upper bound of the sampler correction's ratio (TRL's "
        "vllm_importance_sampling_clip_max); none when unset.")
    sampler_clip_min: float | None = Field(
        default=None, ge=0.0, description="Lower bound of the sampler correction's ratio; none "
        "when unset.")


@dataclass
class RolloutBatch(StepBatch):
    """The rollouts of one batch, prompt-major: rows g*n .. g*n+n-1 are prompt g's samples."""

    step: int                       # first optimizer step that uses this batch
    examples: list[Example]         # one per prompt
    rollouts: list[Rollout]
    grades: list[Grade]
    group_size: int                 # samples per prompt (n)
    rewards: torch.Tensor           # [N] float32
    completion_mask: torch.Tensor   # [N, T] bool (T = longest completion of the batch)
    temperature: float              # the sampler's temperature, used when scoring
    old_logprobs: torch.Tensor | None = None  # [N, T]; None when each batch gets one update
    extra: dict[str, Any] = field(default_factory=dict)  # what the objective prepares
    # [N, T] or [N, 1]: the sampler correction's weights, when another engine drew the rollouts
    sampler_weights: torch.Tensor | None = None
    #: When set, a distillation objective's loss keeps only this kind of token (`disagree`,
    #: `answer`, `eos` or `rest`, as its divergence attribution names them), its normaliser
    #: unchanged: `clbench signal` takes each kind's part of the gradient this way. Never set
    #: by a run.
    loss_token_kind: str | None = None

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def length(self) -> int:
        return int(self.completion_mask.shape[1])

    def example_of(self, row: int) -> Example:
        return self.examples[row // self.group_size]

    def prompt_ids(self, rows: range | None = None) -> list[list[int]]:
        rows = rows if rows is not None else range(self.size)
        return [self.rollouts[i].prompt_ids for i in rows]

    def completion_ids(self, rows: range | None = None) -> list[list[int]]:
        rows = rows if rows is not None else range(self.size)
        return [self.rollouts[i].completion_ids for i in rows]

    def groups_with_signal(self) -> float:
        """Fraction of prompts whose samples do not all have the same reward."""
        grouped = self.rewards.view(-1, self.group_size)
        return float((grouped.max(dim=1).values > grouped.min(dim=1).values).float().mean())

    def score(self, model: torch.nn.Module, rows: range, grad: bool,
              chunk_size: int = 128) -> TokenLogprobs:
        """Log-probs of rows' completions under their own prompts, padded to the batch's T.
        Pass `trainer.train_model` when `grad` is set, so the gradients are synchronised."""
        scored = completion_logprobs(model, self.prompt_ids(rows), self.completion_ids(rows),
                                     grad=grad, temperature=self.temperature,
                                     chunk_size=chunk_size)
        return TokenLogprobs(pad_to(scored.logprobs, self.length),
                             pad_to(scored.mask, self.length))

    def sampler_weights_of(self, rows: range | list[int], length: int,
                           device: torch.device) -> torch.Tensor | None:
        """The sampler correction's weights of `rows`, cut to their first `length` positions
        ([len(rows), length] or [len(rows), 1]); None when the decode loop drew the batch."""
        if self.sampler_weights is None:
            return None
        return self.sampler_weights[list(rows)][:, :length].to(device)

    def corrected(self, per_token: torch.Tensor, rows: range | list[int]) -> torch.Tensor:
        """`per_token` losses of `rows` ([len(rows), T'] with T' <= T) times their sampler
        correction weights, or unchanged when there are none."""
        weights = self.sampler_weights_of(rows, per_token.shape[1], per_token.device)
        return per_token if weights is None else per_token * weights

    def old_or_detached(self, rows: range, current: torch.Tensor) -> torch.Tensor:
        """The sampling policy's log-probs of `rows` (the current ones, detached, on the first
        and only update of a batch, where they are equal by definition)."""
        if self.old_logprobs is None:
            return current.detach()
        return self.old_logprobs[rows.start:rows.stop].to(current.device)


def pad_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad (or cut) the second dimension of a [B, T, ...] tensor to `length` with zeros."""
    if tensor.shape[1] == length:
        return tensor
    if tensor.shape[1] > length:
        return tensor[:, :length]
    shape = (tensor.shape[0], length - tensor.shape[1]) + tuple(tensor.shape[2:])
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=1)


class Objective(StepHooks):
    """An on-policy method's step logic on the shared loop: the batches of sampled, graded and
    scored rollouts are made here (see the module docstring); a subclass gives the loss
    (:meth:`loss`, :meth:`supervised_tokens`), the no-grad work on a fresh batch
    (:meth:`prepare`: advantages, a teacher's scores) and, as any :class:`TrainingHooks`, what
    happens at the stage's start and end and after each step (a teacher's update).

    `config` holds the on-policy settings (:class:`OnPolicySettings`: batch reuse, micro-batches,
    stop strings, the sampler correction). Training forwards go through `loop.train_model`, every
    forward without gradient through `loop.model`."""

    #: An objective holds state between steps only where a subclass says so: one that does not
    #: set this restarts an interrupted stage. A subclass that adds state extends state_dict /
    #: load_state_dict (or sets this back to False).
    resumable: bool = False

    def __init__(self, ctx: StageContext, config: OnPolicySettings, *,
                 generator: Generator | None = None, chunk_size: int = 128) -> None:
        self.ctx = ctx
        self.config = config
        self.batch_every = config.inner_updates
        self.chunk_size = chunk_size
        budget, dist = ctx.budget, ctx.dist
        assert dist is not None  # StageContext always has one
        local_prompts = len(rank_share(range(budget.prompts_per_step), 0, dist.num_processes,
                                       ctx.stage_name))
        rollouts_per_batch = local_prompts * budget.samples_per_prompt
        if generator is None and ctx.generation == "vllm":
            from clbench.train.vllm_engine import colocated_generator

            model_config = getattr(ctx.model, "config", None)
            generator = colocated_generator(
                ctx.model, ctx.tokenizer, seed=dist.process_index,
                max_model_len=int(getattr(model_config, "max_position_embeddings", 4096) or 4096))
        self.generator = generator or HFGenerator(
            ctx.model, ctx.tokenizer,
            batch_size=config.generation_batch_size or rollouts_per_batch, engine=ctx.generation)

    # -- what a subclass gives -----------------------------------------------------------------

    def prepare(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        """No-grad work on a fresh batch (advantages, teacher scores); stores into `batch.extra`.
        Returns statistics logged with the step(s) that use this batch."""
        return {}

    @abstractmethod
    def loss(self, loop: TrainingLoop, batch: StepBatch, part: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of the rows `part` (a range) of the batch, and statistics to be summed over
        micro-batches (and averaged over the ranks).

        Scale: summed over the batch's micro-batches it is this rank's term of the step loss;
        for a token mean use :meth:`RolloutBatch.token_mean`, which divides by the supervised
        tokens of every rank so that several processes take the one-process step.

        Processes: every rank calls this for equally many micro-batches and, under DDP, every
        rank must run the same number of forwards through `loop.train_model` (one per call):
        the ranks' backwards meet in one gradient all-reduce, and a rank that skips it leaves
        the others waiting forever. So a loss with a graph comes from exactly one forward
        through `loop.train_model` (never `loop.model`, whose gradients are not
        synchronised); rows with nothing to learn from return a loss WITHOUT a graph (e.g.
        `torch.zeros(())`, `grad_fn` None) and no forward: the loop then runs
        :meth:`zero_weighted_forward` when there are several processes, and skips the backward
        with one."""

    @abstractmethod
    def supervised_tokens(self, batch: StepBatch) -> int:
        """Number of this rank's completion tokens that receive a learning signal: the count
        the loss is a token mean over. Called after :meth:`prepare`; the loop sums it over
        the ranks into `batch.total_tokens` (which :meth:`RolloutBatch.token_mean` divides by),
        skips the step on every rank when that sum is 0, and counts it as `trained_tokens`."""

    # -- one batch -----------------------------------------------------------------------------

    def build_batch(self, loop: TrainingLoop, step: int, examples: list[Example]
                    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample, grade and score the rollouts of `examples` (this rank's prompts of step
        `step`), then :meth:`prepare` them."""
        ctx, budget, dist = self.ctx, self.ctx.budget, loop.dist
        params = SamplingParams.from_budget(budget, seed=_mix(ctx.seed, step, dist.process_index),
                                            stop=tuple(self.config.stop))
        caps = [ctx.task_for(e).max_new_tokens_for(e) for e in examples]
        if any(c is not None for c in caps):  # items under a tighter cap than the stage's
            params = replace(params, prompt_max_new_tokens=tuple(
                budget.max_new_tokens if c is None else min(c, budget.max_new_tokens)
                for c in caps))
        with loop.clock.phase("generate"):
            rollouts = self.generator.generate([e.messages for e in examples], params)
        self._check_rollouts(rollouts, params)
        with loop.clock.phase("grade"):
            grades = grade_all([(ctx.task_for(examples[r.prompt_index]),
                                 examples[r.prompt_index], r.text) for r in rollouts])
        device = next(loop.model.parameters()).device
        mask = pack_batch([r.prompt_ids for r in rollouts],
                          [r.completion_ids for r in rollouts]).completion_mask.to(device)
        batch = RolloutBatch(
            step=step, examples=examples, rollouts=rollouts, grades=grades,
            group_size=budget.samples_per_prompt,
            rewards=torch.tensor([g.reward for g in grades], dtype=torch.float32, device=device),
            completion_mask=mask,
            temperature=budget.temperature if budget.temperature > 0 else 1.0)
        loop.counters.add("generated_tokens", sum(r.num_tokens for r in rollouts))
        loop.counters.add("rollouts", len(rollouts))
        loop.counters.add("prompts", len(examples))
        with loop.clock.phase("score"):
            stats = self._score_sampling(loop, batch)
            stats = {**self.prepare(loop, batch), **stats}
        return batch, stats

    def _check_rollouts(self, rollouts: list[Rollout], params: SamplingParams) -> None:
        """Refuse what a generator backend returned against its contract."""
        over = [r for r in rollouts if r.num_tokens > params.cap_of(r.prompt_index)]
        if over:  # a backend that ignores the caps would train on more than the budget allows
            raise RuntimeError(f"{type(self.generator).__name__} returned a rollout of "
                               f"{over[0].num_tokens} tokens for a prompt capped at "
                               f"{params.cap_of(over[0].prompt_index)} (SamplingParams.cap_of)")
        uneven = [r for r in rollouts if r.sampler_logprobs is not None
                  and len(r.sampler_logprobs) != r.num_tokens]
        if uneven:  # a log-prob per completion token, or the weights land on the wrong ones
            raise RuntimeError(f"{type(self.generator).__name__} returned "
                               f"{len(uneven[0].sampler_logprobs or [])} sampler log-probs for "
                               f"a completion of {uneven[0].num_tokens} tokens")

    def _score_sampling(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        """The sampling policy's log-probs (when several updates reuse the batch) and the
        sampler correction's weights (when another engine drew the rollouts)."""
        cfg, rollouts, mask = self.config, batch.rollouts, batch.completion_mask
        drawn_elsewhere = cfg.sampler_correction != "none" and all(
            r.sampler_logprobs is not None for r in rollouts)
        if not (self.batch_every > 1 or drawn_elsewhere):
            return {}
        parts = [batch.score(loop.model, rows, grad=False, chunk_size=self.chunk_size).logprobs
                 for rows in self.micro_batches(batch)]
        trainer_logprobs = torch.cat(parts)
        if self.batch_every > 1:
            batch.old_logprobs = trainer_logprobs
        if not drawn_elsewhere:
            return {}
        sampled = pad_to(torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(r.sampler_logprobs or [0.0], dtype=torch.float32)
             for r in rollouts], batch_first=True), batch.length).to(mask.device)
        batch.sampler_weights = sampler_weights(trainer_logprobs, sampled, mask,
                                                cfg.sampler_correction,
                                                clip_max=cfg.sampler_clip_max,
                                                clip_min=cfg.sampler_clip_min)
        per_token = batch.sampler_weights.expand_as(mask)
        return {"sampler_weight_mean": float(per_token[mask].mean()) if mask.any() else 1.0}

    def micro_batches(self, batch: StepBatch) -> list[range]:
        """The row ranges of the batch's micro-batches."""
        assert isinstance(batch, RolloutBatch)
        size = self.config.micro_batch_size or batch.size
        return [range(s, min(s + size, batch.size)) for s in range(0, batch.size, size)]

    def part_sequences(self, batch: StepBatch, part: Any
                       ) -> tuple[list[list[int]], list[list[int]]]:
        assert isinstance(batch, RolloutBatch)
        return batch.prompt_ids(part), batch.completion_ids(part)

    def zero_weighted_forward(self, loop: TrainingLoop, batch: StepBatch, part: Any
                              ) -> torch.Tensor:
        """0 times the log-probs of one row scored through `train_model` (see :meth:`loss`)."""
        assert isinstance(batch, RolloutBatch)
        probe = batch.score(loop.train_model, range(part.start, part.start + 1), grad=True,
                            chunk_size=self.chunk_size)
        return probe.logprobs.sum() * 0.0

    def step_stats(self, batch: StepBatch) -> dict[str, float]:
        assert isinstance(batch, RolloutBatch)
        return batch_summary(batch)


def batch_summary(batch: RolloutBatch) -> dict[str, float]:
    """Reward, correctness, signal and length statistics of a batch (logged every step)."""
    lengths = [r.num_tokens for r in batch.rollouts]
    return {
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
        "correct_rate": sum(g.correct for g in batch.grades) / batch.size,
        "groups_with_signal": batch.groups_with_signal(),
        "completion_tokens_mean": sum(lengths) / len(lengths),
        "finished_rate": sum(r.finished for r in batch.rollouts) / batch.size,
        "repetitive_rate": sum(max_repeat(r.text, REPEAT_N) >= REPEAT_LIMIT
                               for r in batch.rollouts) / batch.size,
        **rollout_entropy(batch.rollouts),
    }


#: A rollout is repetitive when one word 4-gram occurs in it 4 times (the artifact report's
#: defaults, :mod:`clbench.metrics.artifacts`).
REPEAT_N, REPEAT_LIMIT = 4, 4


def rollout_entropy(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """`{"rollout_entropy": H}`: the sampler's entropy per generated token (nats), averaged
    over the batch's tokens; empty when the generator did not measure it."""
    measured = [(r.metadata["entropy"], r.num_tokens) for r in rollouts
                if "entropy" in r.metadata]
    tokens = sum(n for _, n in measured)
    if not measured or len(measured) < len(rollouts) or not tokens:
        return {}
    return {"rollout_entropy": sum(h * n for h, n in measured) / tokens}


def _mix(seed: int, step: int, rank: int = 0) -> int:
    """A sampling seed per (run seed, step, rank); different steps never share a seed, and
    rank 0 samples what a single process samples."""
    mixed = (seed * 2_654_435_761 + step * 40_503 + 1) % (2**31 - 1)
    if rank:
        mixed = (mixed * 1_000_003 + rank * 2_246_822_519) % (2**31 - 1)
    return mixed
