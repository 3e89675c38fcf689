"""SFT on the toy task: it learns, the loss is the response-only NLL, determinism, records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy import LowercaseTask, greedy_reward, tiny, toy_context

from clbench.train.optim import step_examples
from clbench.train.rollout import encode_chat
from clbench_methods.sft import SFT

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


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
    import clbench.train.loop as loop  # SFT's loss is the loop's token mean

    original = loop.token_mean
    monkeypatch.setattr(loop, "token_mean", lambda *args, **kw: -original(*args, **kw))
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


# -- the optimizer helpers every method shares (clbench.train.optim) ---------------------------

def test_step_examples_visit_every_item_once_per_epoch_in_seeded_order() -> None:
    from clbench.train.optim import step_examples

    items = list(range(10))
    epoch = [x for step in range(5) for x in step_examples(items, 2, step, seed=0)]
    assert sorted(epoch) == items and epoch != items
    assert step_examples(items, 2, 3, seed=0) == step_examples(items, 2, 3, seed=0)
    assert step_examples(items, 4, 2, seed=0)[2:] == step_examples(items, 2, 5, seed=0)
    assert [step_examples(items, 2, s, seed=1) for s in range(5)] != [
        step_examples(items, 2, s, seed=0) for s in range(5)]
    with pytest.raises(ValueError, match="no training items"):
        step_examples([], 2, 0, seed=0)


def test_lr_schedules_by_hand() -> None:
    from clbench.train.optim import lr_factor

    # warm-up as verl and transformers schedule it: step s of W takes s / W of the peak
    assert [lr_factor(s, 10, 2, "constant") for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert [lr_factor(s, 16, 10, "constant") for s in range(12)] == [
        0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0]
    # never longer than the stage: the last step of a stage takes the peak lr
    assert [lr_factor(s, 4, 10, "constant") for s in range(4)] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert lr_factor(0, 1, 10, "constant") == 1.0
    assert [lr_factor(s, 6, 2, "linear") for s in (2, 3, 5)] == [1.0, 0.75, 0.25]
    assert lr_factor(2, 6, 2, "cosine") == pytest.approx(1.0)
    assert lr_factor(4, 6, 2, "cosine") == pytest.approx(0.5)


def test_weight_decay_spares_biases_and_norms_and_clipping_reports_the_raw_norm() -> None:
    from clbench.train.optim import OptimizerSettings, build_optimizer, clip_gradients

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimizerSettings(weight_decay=0.1), lr=1e-3)
    decays = {tuple(p.shape): g["weight_decay"] for g in optimizer.param_groups
              for p in g["params"]}
    assert decays == {(4, 3): 0.1, (4,): 0.0}
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)  # 12 + 4 + 4 + 4 entries of 2 -> norm 2 * sqrt(24)
    assert clip_gradients(model, 1.0) == pytest.approx(2 * 24 ** 0.5)
    assert clip_gradients(model, None) == pytest.approx(1.0, rel=1e-5)  # already clipped


def test_sft_trains_on_what_follows_the_start_of_the_response_the_prompt_holds() -> None:
    """In the reasoning format the prompt opens the block; the target is the rest of the
    reference (its working, the closing tag, the answer) and the EOS, never the prefix twice."""
    from types import SimpleNamespace

    from clbench.models import build_char_tokenizer
    from clbench.plugins.registry import build_task
    from clbench.spec.schema import TaskSpec
    from clbench.tasks.base import THINK_PREFIX
    from clbench_methods.sft import SFTConfig, SFTHooks

    tok = build_char_tokenizer()
    example = build_task(TaskSpec(source="math.arithmetic", params={"think": True})).examples(
        "train", 0, 1)[0]
    prompt, response = SFTHooks(SFTConfig(), SimpleNamespace(tokenizer=tok)).encode(example)
    assert tok.decode(prompt).endswith(THINK_PREFIX)
    assert tok.decode(response[:-1]) == example.reference[len(THINK_PREFIX):]
    assert response[-1] == tok.eos_token_id

