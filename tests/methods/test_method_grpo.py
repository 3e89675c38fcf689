"""GRPO on the toy task: it learns, the sign matters, numbers match hand computation, knobs work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy import tiny, toy_context

from clbench.train.loop import TrainingLoop
from clbench_methods.grpo import GRPO, GRPOConfig, GRPOObjective

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


def run_grpo(tmp_path: Path, steps: int, lr: float = 1e-2, seed: int = 0, **config) -> list[dict]:
    model, tok = tiny(seed=0)
    report = GRPO({"lr": lr, **config}).train_stage(toy_context(model, tok, tmp_path,
                                                                steps=steps, seed=seed))
    return report.steps


def reward_gain(steps: list[dict]) -> float:
    first = sum(r["reward_mean"] for r in steps[:5]) / 5
    last = sum(r["reward_mean"] for r in steps[-5:]) / 5
    return last - first


def test_grpo_raises_the_toy_reward(tmp_path: Path) -> None:
    steps = run_grpo(tmp_path, steps=30)
    assert steps[0]["reward_mean"] < 0.5
    assert reward_gain(steps) > 0.3


def test_grpo_with_the_loss_sign_flipped_does_not_learn(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    original = GRPOObjective.loss

    def flipped(self, loop, batch, rows):
        loss, stats = original(self, loop, batch, rows)
        return -loss, stats

    monkeypatch.setattr(GRPOObjective, "loss", flipped)
    assert reward_gain(run_grpo(tmp_path, steps=30)) < 0.05


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path: Path) -> None:
    a = run_grpo(tmp_path, steps=3)
    b = run_grpo(tmp_path, steps=3)
    c = run_grpo(tmp_path, steps=3, seed=1)
    keys = ("loss", "reward_mean", "grad_norm")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [r["reward_mean"] for r in a] != [r["reward_mean"] for r in c]


def test_first_step_loss_is_the_token_mean_of_minus_advantage(tmp_path: Path) -> None:
    model, tok = tiny()
    ctx = toy_context(model, tok, tmp_path, steps=1)
    cfg = GRPOConfig()
    loop = TrainingLoop(ctx, cfg, GRPOObjective(ctx, cfg))
    batch, _ = loop.new_batch(0)
    rewards = torch.tensor([g.reward for g in batch.grades]).view(4, 4)
    advantages = (rewards - rewards.mean(1, keepdim=True)).flatten()
    lengths = torch.tensor([len(r.completion_ids) for r in batch.rollouts], dtype=torch.float32)
    # ratio = 1 on the only update, so each token's loss is -A of its rollout.
    expected = float(-(advantages * lengths).sum() / lengths.sum())
    # advantages sum to 0 in each group: only uneven lengths make the token mean non-zero, so a
    # zero, sign-flipped or per-rollout mean loss would differ from it
    assert len(set(lengths.tolist())) > 1 and abs(expected) > 1e-3
    record = loop.update(batch)
    assert record["loss"] == pytest.approx(expected, abs=1e-6)
    assert record["clip_fraction"] == 0.0
    assert record["lr"] == pytest.approx(1e-6)


def test_records_counters_and_budget_lr_override(tmp_path: Path) -> None:
    model, tok = tiny()
    log: list[dict] = []
    ctx = toy_context(model, tok, tmp_path, steps=2, lr=3e-4, log=log)
    report = GRPO().train_stage(ctx)
    assert log == report.steps and len(log) == 2
    for key in ("loss", "reward_mean", "groups_with_signal", "supervised_token_fraction",
                "grad_norm", "lr", "clip_fraction", "seconds"):
        assert key in log[0], key
    assert log[0]["lr"] == pytest.approx(3e-4)  # the stage budget beats the method default
    assert report.counters["rollouts"] == 32 and report.counters["optimizer_steps"] == 2
    assert report.counters["generated_tokens"] == report.counters["trained_tokens"] > 0
    assert set(report.wall_time) >= {"generate", "grade", "score", "backward", "step"}


def test_several_updates_per_batch_reuse_rollouts_and_move_the_ratio(tmp_path: Path) -> None:
    steps = run_grpo(tmp_path, steps=4, lr=5e-2, inner_updates=2)
    # Two batches of 16 rollouts for four optimizer steps.
    assert [r["reward_mean"] for r in steps[::2]] == [r["reward_mean"] for r in steps[1::2]]
    assert steps[0]["clip_fraction"] == 0.0  # first update: ratio exactly 1
    assert steps[1]["clip_fraction"] > 0.0   # second update: the policy has moved


def test_kl_to_the_stage_start_is_zero_first_then_grows(tmp_path: Path) -> None:
    steps = run_grpo(tmp_path, steps=3, lr=5e-2, beta=0.1)
    assert steps[0]["kl_to_start"] == pytest.approx(0.0, abs=1e-7)
    assert steps[2]["kl_to_start"] > 1e-4


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="eps_low"):
        GRPO({"eps_low": 1.5})
    with pytest.raises(ValueError, match="extra"):
        GRPO({"clip": 0.2})


def test_generation_batch_size_splits_the_steps_rollouts(tmp_path: Path, monkeypatch) -> None:
    """16 rollouts a step (4 prompts x 4 samples) generated 4 at a time: four generate calls of
    at most 4 rows each, and training goes on as usual."""
    from clbench.train import decoding

    sizes: list[int] = []
    real = decoding.decode

    def decode(model, input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[0])
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(decoding, "decode", decode)
    steps = run_grpo(tmp_path, steps=2, generation_batch_size=4)
    assert len(steps) == 2 and sizes == [4] * 8
    sizes.clear()
    run_grpo(tmp_path, steps=1)
    assert sizes == [16]  # the whole share at once by default
