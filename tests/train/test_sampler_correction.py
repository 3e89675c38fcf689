"""The sampler/trainer mismatch correction (clbench/train/sampler_correction.py): TRL's four
modes by hand, the weights the on-policy trainer puts on a batch drawn by another engine, and
the GRPO and SDPO losses they scale."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from toy import FixedGenerator, tiny, toy_context

from clbench.train import losses
from clbench.train.logprobs import completion_logprobs
from clbench.train.loop import TrainingLoop
from clbench.train.rollout import Generator, Rollout, SamplingParams
from clbench.train.sampler_correction import sampler_weights
from methods.grpo import GRPOConfig, GRPOObjective

# two completions of 3 positions; the second has 2 tokens (its third position is padding)
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.3 - math.log(5), 7.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
# log-ratios: row 0 +0.5, -1, 0 (sum -0.5); row 1 0, +log 5, (padding: 0) (sum log 5)


def test_token_modes_clip_or_drop_each_token_by_hand() -> None:
    truncated = sampler_weights(TRAINER, SAMPLER, MASK, "token_truncate", clip_max=3.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, 3.0, 1.0]])
    torch.testing.assert_close(truncated, expected)
    masked = sampler_weights(TRAINER, SAMPLER, MASK, "token_mask", clip_max=3.0, clip_min=0.5)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(0.5), 0.0, 1.0],
                                                     [1.0, 0.0, 1.0]]))


def test_sequence_modes_use_the_product_of_a_completions_ratios_by_hand() -> None:
    truncated = sampler_weights(TRAINER, SAMPLER, MASK, "sequence_truncate", clip_max=3.0)
    torch.testing.assert_close(truncated, torch.tensor([[math.exp(-0.5)], [3.0]]))
    # TRL's default: a completion whose ratio (5) lies above 3 is dropped whole
    masked = sampler_weights(TRAINER, SAMPLER, MASK)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(-0.5)], [0.0]]))
    assert sampler_weights(TRAINER, SAMPLER, MASK, "none") is None


def test_the_weights_carry_no_gradient_and_missing_sampler_logprobs_count_as_agreement() -> None:
    trainer = TRAINER.clone().requires_grad_(True)
    sampler = SAMPLER.clone()
    sampler[0, 1] = float("nan")  # the engine gave no log-prob for this token
    weights = sampler_weights(trainer, sampler, MASK, "token_truncate", clip_max=10.0)
    assert not weights.requires_grad
    assert weights[0, 1].item() == 1.0


class OffsetEngine(Generator):
    """FixedGenerator's rollouts with sampler log-probs: the trainer's own minus `offset` per
    token (so each token's ratio p_trainer / p_sampler is exp(offset))."""

    def __init__(self, model, tokenizer, offset: float) -> None:
        self.tokenizer, self.model, self.offset = tokenizer, model, offset
        self.inner = FixedGenerator(tokenizer)

    def generate_from_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams
                          ) -> list[Rollout]:
        rollouts = self.inner.generate_from_ids(prompt_ids, params)
        scored = completion_logprobs(self.model, [r.prompt_ids for r in rollouts],
                                     [r.completion_ids for r in rollouts])
        for i, r in enumerate(rollouts):
            r.sampler_logprobs = [float(v) - self.offset
                                  for v in scored.logprobs[i, :r.num_tokens]]
        return rollouts


def _batch(tmp_path: Path, offset: float, **settings):
    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1)
    config = GRPOConfig(**settings)
    objective = GRPOObjective(ctx, config, generator=OffsetEngine(model, tok, offset))
    loop = TrainingLoop(ctx, config, objective)
    batch, stats = loop.new_batch(0)
    return loop, objective, batch, stats


def test_the_trainer_weights_a_batch_drawn_elsewhere(tmp_path: Path) -> None:
    log2 = math.log(2.0)
    # every token twice as likely under the trainer: token_truncate weights them all 2
    _, _, batch, stats = _batch(tmp_path / "a", log2, sampler_correction="token_truncate")
    torch.testing.assert_close(batch.sampler_weights[batch.completion_mask],
                               torch.full((int(batch.completion_mask.sum()),), 2.0))
    assert stats["sampler_weight_mean"] == pytest.approx(2.0)
    # sequence_mask: a completion of L tokens has ratio 2^L; above 3 from 2 tokens on
    _, _, batch, stats = _batch(tmp_path / "b", log2)
    lengths = [r.num_tokens for r in batch.rollouts]
    assert min(lengths) == 1 and max(lengths) > 1  # both cases occur
    expected = torch.tensor([[2.0 if n == 1 else 0.0] for n in lengths])
    torch.testing.assert_close(batch.sampler_weights, expected)
    kept = sum(n for n in lengths if n == 1)
    assert stats["sampler_weight_mean"] == pytest.approx(2.0 * kept / sum(lengths))
    # the trainer's own samples (the decode loop) get no weights
    _, _, batch, stats = _batch(tmp_path / "c", 0.0, sampler_correction="none")
    assert batch.sampler_weights is None and "sampler_weight_mean" not in stats


def _losses_with_and_without_weights(objective, batch, loop) -> tuple[float, float]:
    """The batch's loss with its sampler weights, then with none; the plain one is not 0, so a
    ratio between them means something."""
    rows = range(batch.size)
    weighted, _ = objective.loss(loop, batch, rows)
    batch.sampler_weights = None
    plain, _ = objective.loss(loop, batch, rows)
    assert plain.item() != 0.0
    return weighted.item(), plain.item()


def test_grpo_and_sdpo_losses_scale_by_the_weights(tmp_path: Path) -> None:
    loop, objective, batch, _ = _batch(tmp_path, math.log(2.0),
                                       sampler_correction="token_truncate")
    # advantages of both signs, so the surrogate is not 0
    batch.extra["advantages"] = torch.linspace(-1.0, 1.0, batch.size)
    weighted, plain = _losses_with_and_without_weights(objective, batch, loop)
    assert weighted == pytest.approx(2.0 * plain, rel=1e-6)
    # SDPO: the sampled-token terms of test_losses, -d for d = 1..6, weighted per completion
    student = losses.DistillationScores(-torch.ones(2, 3))
    teacher = losses.DistillationScores(-1 - torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    terms = losses.sdpo_loss(student, teacher, mask, divergence="sampled_token",
                             sampler_weights=torch.tensor([[0.5], [2.0]]))
    assert terms.loss.item() == pytest.approx(-(0.5 * (1 + 2) + 2.0 * 4) / 3)


def test_an_engine_with_the_wrong_number_of_sampler_logprobs_is_refused(tmp_path: Path) -> None:
    model, tok = tiny(seed=0)

    class Short(OffsetEngine):
        def generate_from_ids(self, prompt_ids, params):
            rollouts = super().generate_from_ids(prompt_ids, params)
            rollouts[0].sampler_logprobs = rollouts[0].sampler_logprobs + [0.0]
            return rollouts

    ctx = toy_context(model, tok, tmp_path, steps=1)
    loop = TrainingLoop(ctx, GRPOConfig(), GRPOObjective(ctx, GRPOConfig(),
                                                         generator=Short(model, tok, 0.0)))
    with pytest.raises(RuntimeError, match=r"Short returned \d+ sampler log-probs for a "
                                           r"completion of \d+ tokens"):
        loop.new_batch(0)


def test_an_sdpo_step_on_a_batch_drawn_elsewhere_scales_by_the_weights(tmp_path: Path) -> None:
    from methods.sdpo.method import SDPOConfig, SDPOObjective

    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1)
    # the verifier's feedback gives every failed rollout a teacher, so every row has a loss
    config = SDPOConfig(feedback="rich", sampler_correction="token_truncate")
    objective = SDPOObjective(ctx, config, generator=OffsetEngine(model, tok, math.log(2.0)))
    loop = TrainingLoop(ctx, config, objective)
    objective.on_stage_start(loop)
    batch, _ = loop.new_batch(0)
    weighted, plain = _losses_with_and_without_weights(objective, batch, loop)
    assert weighted == pytest.approx(2.0 * plain, rel=1e-5)
