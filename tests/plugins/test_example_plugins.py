"""The example plugins under examples/plugins/, installed by `make setup` like any third party's:
a method (`rft`, rejection-sampling fine-tuning), an add-on (`l2sp`) and a task source
(`units.conversion`). Each does what it claims, imports only `clbench.api` (the import-linter
contract in `make lint`), and runs a suite end to end, recorded with its distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from toy import one_thread, tiny, toy_context
from where import SMOKE

from clbench.cli import cli
from clbench.plugins import registry
from clbench.spec.schema import AddOnSpec

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


def _load(group: str, name: str) -> type:
    try:
        return registry._load_class(group, name)
    except registry.PluginError as exc:
        raise AssertionError(f"{exc} (`make setup` installs examples/plugins/)") from None


@pytest.mark.e2e
def test_the_examples_run_the_smoke_suite_and_are_recorded(tmp_path: Path) -> None:
    suite = tmp_path / "units.yaml"
    smoke = SMOKE.read_text()
    arithmetic = 'source: math.arithmetic\n      params: {digits: 1, operands: 2, operators: "+"}'
    assert arithmetic in smoke
    suite.write_text(smoke.replace(arithmetic, "source: units.conversion"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method", "rft",
                                      "--addon", "l2sp", "--out", str(out), "--no-base-cache"])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "results.json").read_text())
    assert recorded["status"] == "complete"
    assert (recorded["method"]["distribution"], recorded["method"]["version"]) == \
        ("clbench-rft", "0.1.0")
    assert [(a["name"], a["distribution"]) for a in recorded["addons"]] == \
        [("l2sp", "clbench-l2sp")]
    assert recorded["columns"][0]["source"] == "units.conversion"
    # the examples live in clbench's checkout: their code's commit is clbench's
    assert recorded["method"]["git_revision"] == recorded["git_revision"]


def test_rft_learns_from_its_accepted_rollouts_and_skips_a_step_with_none(
        tmp_path: Path) -> None:
    rft = _load(registry.METHODS_GROUP, "rft")
    model, tok = tiny()
    # a reward of at least 0.75 (6 of the 8 letters lowercase) is accepted
    with one_thread():
        report = rft({"lr": 1e-2, "threshold": 0.75}).train_stage(
            toy_context(model, tok, tmp_path, steps=30))
    steps = report.steps
    first = sum(r["reward_mean"] for r in steps[:5]) / 5
    last = sum(r["reward_mean"] for r in steps[-5:]) / 5
    assert last - first > 0.3, (first, last)
    model, tok = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    with one_thread():
        report = rft({"threshold": 1.0}).train_stage(  # no rollout of a new model is perfect
            toy_context(model, tok, tmp_path, steps=1))
    assert report.steps[0]["kept_fraction"] == 0.0 and report.counters["trained_tokens"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_l2sp_holds_the_weights_near_the_stage_start(tmp_path: Path) -> None:
    from clbench_methods.sft import SFT

    distances = {}
    for strength in (0.0, 50.0):
        model, tok = tiny()
        start = [p.detach().clone() for p in model.parameters()]
        ctx = toy_context(model, tok, tmp_path, steps=8)
        ctx.addons = registry.build_addons([AddOnSpec(name="l2sp",
                                                      params={"strength": strength})])
        with one_thread():
            report = SFT({"lr": 1e-2}).train_stage(ctx)
        distances[strength] = sum(float((p.detach() - s).pow(2).sum())
                                  for p, s in zip(model.parameters(), start))
        penalties = [r.get("l2sp_penalty", 0.0) for r in report.steps]
        # the penalty is strength/2 times the squared distance before each step: 0 at first
        assert penalties[0] == 0.0 and (penalties[-1] > 0) == (strength > 0)
    assert distances[50.0] < 0.5 * distances[0.0], distances


def test_unit_conversion_grades_values_formats_and_keeps_splits_apart() -> None:
    units = _load(registry.TASKS_GROUP, "units.conversion")
    task = units({"kinds": ["length"]})
    train, evaluation = task.examples("train", 0, 40), task.examples("eval", 0, 10)
    assert not {e.messages[-1]["content"] for e in train} & \
        {e.messages[-1]["content"] for e in evaluation}
    assert task.examples("eval", 0, 10) == evaluation  # the same items from the same seed
    example = evaluation[0]
    assert all(task.grade(e, e.reference).correct for e in train + evaluation)
    value = example.answer
    assert task.grade(example, f"So it is {value}.\nAnswer: {value}").reward == 1.0
    wrong = task.grade(example, f"Answer: {value}1")
    assert not wrong.correct and wrong.feedback == f"The answer {value}1 is wrong."
    unread = task.grade(example, f"It is {value}.")
    assert not unread.correct and unread.format_error
    with pytest.raises(ValueError):
        units({"kinds": ["volume"]})
    # "Convert 2 m to cm." is the worked example: never drawn
    assert all("Convert 2 m to cm." != e.messages[-1]["content"].split(" End")[0]
               for e in train + evaluation)


def test_unit_conversion_answers_by_the_units_factors() -> None:
    units = _load(registry.TASKS_GROUP, "units.conversion")
    import re

    for example in units({"kinds": ["time"]}).examples("train", 1, 20):
        question = example.messages[-1]["content"]
        quantity, source, target = re.match(r"Convert (\S+) (\S+) to (\S+)\.", question).groups()
        seconds = {"s": 1, "min": 60, "h": 3600}
        expected = float(quantity) * seconds[source] / seconds[target]
        assert float(example.answer) == pytest.approx(expected, rel=1e-9), question
