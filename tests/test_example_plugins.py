"""The example plugins under examples/plugins/, installed by `make setup` like any third party's:
EWC-regularised SFT (a penalty hook of the shared training loop) and replay (earlier stages'
items mixed into each step). Each must do what it claims and run a suite end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from toy import LowercaseTask, tiny, toy_context

from clbench.cli import cli
from clbench.plugins import registry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


EXAMPLES = {"ewc-sft": "clbench-ewc", "replay-sft": "clbench-replay"}




def _import(method: str):
    try:
        return registry.load_method_class(method)
    except registry.PluginError as exc:
        raise AssertionError(f"{exc} (`make setup` installs examples/plugins/)") from None


@pytest.mark.e2e
@pytest.mark.parametrize("method", sorted(EXAMPLES))
def test_an_example_plugin_runs_the_smoke_suite_and_is_recorded(method: str,
                                                                tmp_path: Path) -> None:
    _import(method)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method,
                                      "--out", str(out), "--no-base-cache"])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "results.json").read_text())
    assert recorded["status"] == "complete"
    assert recorded["method"]["distribution"] == EXAMPLES[method]
    assert recorded["method"]["version"] == "0.1.0"
    # the example lives in clbench's checkout: its code's commit is clbench's
    assert recorded["method"]["git_revision"] == recorded["git_revision"]


def test_ewc_keeps_the_important_weights_near_those_after_the_earlier_stage(tmp_path: Path
                                                                         ) -> None:
    """What EWC claims: the Fisher-weighted distance sum F (theta - theta*)^2 from the weights
    after stage 1 stays far smaller than under SFT. (Weights with no Fisher move as under SFT:
    Adam moves every weight with a gradient by about lr per step.)"""
    ewc = _import("ewc-sft")
    moved, penalties = {}, {}
    for strength in (0.0, 100.0):
        model, tok = tiny()
        method = ewc({"lr": 1e-2, "ewc_lambda": strength, "fisher_items": 8})
        method.train_stage(toy_context(model, tok, tmp_path, steps=6))
        assert len(method.anchor) == len(list(model.parameters()))
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        fisher = {n: f.clone() for n, f in method.fisher.items()}
        report = method.train_stage(toy_context(model, tok, tmp_path, steps=6, seed=1,
                                                task=LowercaseTask({"k": 4})))
        moved[strength] = sum(float((fisher[n] * (p.detach() - anchor[n]).pow(2)).sum())
                              for n, p in model.named_parameters())
        penalties[strength] = [r["ewc_penalty"] for r in report.steps]
    assert penalties[0.0] == [0.0] * 6
    assert penalties[100.0][0] == 0.0 < penalties[100.0][-1]  # at the anchor, then away
    # the last penalty is lambda/2 times the distance after the step before the last
    assert moved[100.0] < 0.2 * moved[0.0], moved


def test_ewc_without_strength_is_sft_and_its_state_outlives_a_checkpoint(tmp_path: Path) -> None:
    from clbench_methods.sft import SFT

    ewc = _import("ewc-sft")
    losses = []
    for method in (SFT({"lr": 1e-2}), ewc({"lr": 1e-2, "ewc_lambda": 0.0})):
        model, tok = tiny()
        report = method.train_stage(toy_context(model, tok, tmp_path, steps=4))
        losses.append([r["loss"] for r in report.steps])
    assert losses[0] == losses[1]
    restored = ewc()
    restored.load_state_dict(method.state_dict())
    assert restored.fisher.keys() == method.fisher.keys()
    assert all(torch.equal(restored.anchor[n], method.anchor[n]) for n in method.anchor)


def test_replay_mixes_earlier_stages_items_into_each_step(tmp_path: Path) -> None:
    replay = _import("replay-sft")
    model, tok = tiny()
    method = replay({"lr": 1e-2, "replay_fraction": 0.25, "buffer_per_stage": 6})
    trained: list[str] = []
    encode = method.encode
    method.encode = lambda ctx, example: (trained.append(example.id), encode(ctx, example))[1]
    first = toy_context(model, tok, tmp_path, steps=2)
    report = method.train_stage(first)
    assert [r["replayed_fraction"] for r in report.steps] == [0.0, 0.0]
    buffered = {e.id for e in method.buffer}
    assert len(buffered) == 6 and buffered <= {e.id for e in first.train_examples}

    trained.clear()
    second = toy_context(model, tok, tmp_path, steps=3, seed=1, task=LowercaseTask({"k": 4}))
    second.train_examples = [dataclasses.replace(e, id=f"second-{e.id}")
                             for e in second.train_examples]
    report = method.train_stage(second)
    assert [r["replayed_fraction"] for r in report.steps] == [0.25] * 3
    own = {e.id for e in second.train_examples}
    assert len(trained) == 12 and sum(i in buffered for i in trained) == 3  # 1 of 4 per step
    assert all(i in own or i in buffered for i in trained)
    assert len(method.buffer) == 12

    restored = replay()
    restored.load_state_dict(method.state_dict())
    assert restored.buffer == method.buffer
