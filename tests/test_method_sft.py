"""SFT on the toy task: it learns, the loss is the response-only NLL, determinism, records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clbench.engine.optim import step_examples
from clbench.engine.rollout import encode_chat
from clbench_methods.sft import SFT
from toy import LowercaseTask, greedy_reward, one_thread, tiny, toy_context


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_sft_raises_the_greedy_toy_reward(tmp_path: Path) -> None:
    model, tok = tiny()
    task = LowercaseTask({"k": 8})
    before = greedy_reward(model, tok, task)
    report = SFT({"lr": 1e-2}).train_stage(toy_context(model, tok, tmp_path, steps=30))
    after = greedy_reward(model, tok, task)
    assert before < 0.5
    assert after > before + 0.4
    assert report.steps[-1]["loss"] < report.steps[0]["loss"] - 0.5


def test_sft_with_the_loss_sign_flipped_does_not_learn(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import clbench_methods.sft as sft

    original = sft.token_mean
    monkeypatch.setattr(sft, "token_mean", lambda *args, **kw: -original(*args, **kw))
    model, tok = tiny()
    task = LowercaseTask({"k": 8})
    before = greedy_reward(model, tok, task)
    SFT({"lr": 1e-2}).train_stage(toy_context(model, tok, tmp_path, steps=30))
    assert greedy_reward(model, tok, task) < before + 0.1


def test_first_loss_is_the_nll_of_the_response_tokens_only(tmp_path: Path) -> None:
    model, tok = tiny()
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=3)
    expected_examples = step_examples(ctx.train_examples, 3, 0, ctx.seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in expected_examples:
            prompt = encode_chat(tok, example.messages)
            response = tok(example.reference, add_special_tokens=False)["input_ids"]
            response = response + [tok.eos_token_id]
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
            logp = logits[len(prompt) - 1:-1].log_softmax(-1)
            total -= float(logp.gather(-1, torch.tensor(response)[:, None]).sum())
            count += len(response)
    report = SFT({"lr": 1e-3}).train_stage(ctx)
    assert report.steps[0]["loss"] == pytest.approx(total / count, rel=1e-5)
    assert report.counters["trained_tokens"] == count
    assert report.steps[0]["lr"] == pytest.approx(1e-3)


def test_micro_batches_give_the_same_update(tmp_path: Path) -> None:
    losses = []
    weights = []
    for micro in (None, 1):
        model, tok = tiny()
        report = SFT({"micro_batch_size": micro}).train_stage(
            toy_context(model, tok, tmp_path, steps=2))
        losses.append([r["loss"] for r in report.steps])
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(weights[0], weights[1], atol=1e-6, rtol=1e-5)


def test_same_seed_same_losses_and_default_lr(tmp_path: Path) -> None:
    runs = []
    for _ in range(2):
        model, tok = tiny()
        runs.append(SFT().train_stage(toy_context(model, tok, tmp_path, steps=3)))
    assert [r["loss"] for r in runs[0].steps] == [r["loss"] for r in runs[1].steps]
    assert runs[0].steps[0]["lr"] == pytest.approx(1e-5)
    assert set(runs[0].wall_time) == {"backward", "step"}
