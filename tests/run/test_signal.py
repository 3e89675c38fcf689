"""`clbench signal`: the cosine of a method's update with the way to the references of
validation items, and between batches, on a tiny model."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from fakes import run_cli, run_spec

from clbench.api import SFT, Example, SFTHooks, StageContext
from clbench.plugins import registry
from clbench.run.signal import measure_signal

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("single_thread")]


class ConstantHooks(SFTHooks):
    """Always the same words, whatever the prompt: a loss that only shifts style."""

    def encode(self, example: Example) -> tuple[list[int], list[int]]:
        prompt, _ = super().encode(example)
        return prompt, self.ctx.tokenizer.encode(" the same words again", add_special_tokens=False)


class ConstantTarget(SFT):
    name: ClassVar[str] = "test.constant-target"

    def hooks(self, ctx: StageContext) -> ConstantHooks:
        return ConstantHooks(self.config, ctx)


def test_sft_points_towards_the_references_of_unseen_items() -> None:
    result = run_cli(["signal", "--suite", "smoke", "--method", "sft", "--batches", "3",
                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output)
    assert {"alignment", "adam_alignment", "consistency", "forgetting_alignment"} <= set(measured)
    assert measured["alignment"]["mean"] > 0.3
    assert measured["alignment"]["low"] <= measured["alignment"]["mean"] <= \
        measured["alignment"]["high"]
    assert measured["forgetting_alignment"] == {}  # the first stage: nothing earlier
    assert len(measured["per_batch"]["alignment"]) == 3


def test_a_loss_that_only_shifts_style_is_consistent_and_not_aligned() -> None:
    with registry.extra_plugins(methods={"test.constant-target": ConstantTarget}):
        run = run_spec("smoke", "test.constant-target", device="cpu")
        constant = measure_signal(run, batches=4)
        sft = measure_signal(run_spec("smoke", "sft", device="cpu"), batches=4)
    assert constant.consistency.mean > 0.9           # the same direction on every batch
    # and hardly towards the references (what is left is the softmax's share: raising any
    # tokens lowers the rest, on a random model partly the same rest)
    assert abs(constant.alignment.mean) < 0.3
    assert sft.alignment.mean > constant.alignment.mean + 0.4


def test_a_later_stage_reports_alignment_with_each_earlier_task() -> None:
    result = measure_signal(run_spec("smoke", "sft", device="cpu",
                                     overrides=["stages[0].budget.steps=2"]),
                            stage=2, batches=2, validation_items=8)
    assert result.stage == "science"
    assert list(result.forgetting_alignment) == ["math"]
    assert -1.0 <= result.forgetting_alignment["math"].mean <= 1.0


@pytest.mark.parametrize(("args", "message"), [
    (["--stage", "9"], "--stage 9: the suite has stages 1 to 2"),
    (["--batches", "1"], "Invalid value for '--batches'"),
])
def test_bad_arguments_are_one_message(args: list[str], message: str) -> None:
    result = run_cli(["signal", "--suite", "smoke", "--method", "sft", "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_sdpo_reports_where_its_divergence_falls() -> None:
    result = measure_signal(run_spec("smoke", "sdpo", device="cpu"), batches=2,
                            validation_items=8)
    shares = {k: v.mean for k, v in result.token_attribution.items()}
    assert set(shares) == {"disagree", "answer", "eos", "rest"}
    assert all(0.0 <= v <= 1.0 + 1e-6 for v in shares.values())
    # the rest is what no other kind holds
    assert shares["rest"] <= 1.0 - max(shares["answer"], shares["eos"], shares["disagree"]) + 1e-6
    # and each kind's part of the gradient: its norm relative to the whole and its direction
    assert set(result.gradient_share) == set(shares) == set(result.alignment_by_kind)
    assert all(v.mean >= 0.0 for v in result.gradient_share.values())
    assert all(-1.0 <= v.mean <= 1.0 for v in result.alignment_by_kind.values())
    assert len(result.per_batch["gradient_share:answer"]) == 2 - result.silent_batches
    assert measure_signal(run_spec("smoke", "sft", device="cpu"),
                          batches=2).token_attribution == {}  # no divergence to split
