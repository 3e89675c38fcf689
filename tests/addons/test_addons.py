"""The continual-learning add-ons: each does what it claims, with any method, and composes in the
order a run lists them; a run records them and `report` keys its entry by them."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fakes import SUITE, run_cli, write_suite
from toy import LowercaseTask, one_thread, tiny, toy_context
from where import SMOKE

from clbench.api import STAGE_KEY, Grade, StageContext
from clbench.cli import cli
from clbench.plugins import registry
from clbench.results import read_results
from clbench.spec.schema import AddOnSpec
from clbench.train.loop import StepHooks as StepHooksBase
from clbench.train.loop import TrainingLoop
from clbench_methods.grpo import GRPO
from clbench_methods.sft import SFT, SFTConfig, SFTHooks

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


def addons(*specs: Any) -> list[Any]:
    """Built add-ons from names or (name, params) pairs."""
    return registry.build_addons([AddOnSpec(name=s) if isinstance(s, str) else
                                  AddOnSpec(name=s[0], params=s[1]) for s in specs])


def stage(tmp_path: Path, model: Any, tok: Any, attached: list[Any], *, seed: int = 0,
          steps: int = 6, k: int = 8, name: str = "toy") -> StageContext:
    """A toy stage with the run's add-ons attached, its items marked with their stage."""
    ctx = toy_context(model, tok, tmp_path, steps=steps, seed=seed, task=LowercaseTask({"k": k}))
    ctx.stage_name = name
    ctx.train_examples = [dataclasses.replace(e, id=f"{name}-{e.id}",
                                              metadata={**e.metadata, STAGE_KEY: name})
                          for e in ctx.train_examples]
    ctx.addons = attached
    return ctx


# ---------------------------------------------------------------------------------------------
# What is installed
# ---------------------------------------------------------------------------------------------

def test_the_built_in_addons_are_listed_and_documented() -> None:
    listed = CliRunner().invoke(cli, ["list", "addons"])
    assert listed.exit_code == 0, listed.output
    for name in ("replay", "ewc", "lwf", "merge"):
        assert f" {name} " in listed.output
    shown = CliRunner().invoke(cli, ["addons", "show", "replay"])
    assert shown.exit_code == 0 and "buffer_per_stage" in shown.output and "0.25" in shown.output
    unknown = CliRunner().invoke(cli, ["addons", "show", "replya"])
    assert unknown.exit_code == 2
    assert "unknown add-on 'replya'. Did you mean 'replay'?" in " ".join(unknown.output.split())


def test_addon_settings_are_validated_and_named_by_path(tmp_path: Path) -> None:
    common = ["run", "--suite", "smoke", "--method", "sft", "--plan"]
    cases = {
        ("--addon", "ewc", "--set", "addon.ewc.strenght=1"): "addon.ewc.strenght: unknown field",
        ("--addon", "ewc", "--set", "addon.ewc.strength=-1"):
            "addon.ewc.strength: Input should be greater than or equal to 0",
        ("--set", "addon.ewc.strength=1",): "--set addon.ewc.*: the run has no add-on 'ewc' "
                                            "(its add-ons: none); add --addon ewc",
        ("--addon", "ewk"): "unknown add-on 'ewk'. Did you mean 'ewc'?",
    }
    for args, message in cases.items():
        res = CliRunner().invoke(cli, [*common, *args])
        assert res.exit_code == 2, res.output
        assert message in " ".join(res.output.split()), res.output
    planned = CliRunner().invoke(cli, [*common, "--addon", "replay", "--addon", "ewc", "--set",
                                       "addon.ewc.strength=5"])
    assert planned.exit_code == 0, planned.output
    assert "method sft + replay + ewc" in planned.output
    assert "runs/smoke/sft+replay+ewc/s0" in planned.output
    assert 'add-on ewc {"strength": 5.0, "fisher_items": 16, "decay": 1.0}' in planned.output


def test_a_suites_addons_list_is_validated_and_the_command_line_appends_to_it(
        tmp_path: Path) -> None:
    from fakes import run_spec

    smoke = SMOKE.read_text()
    suite = tmp_path / "s.yaml"
    suite.write_text(smoke + "addons: [replay, {name: lwf, params: {weight: 0.5}}]\n")
    run = run_spec(suite, "sft", addons=["ewc", "replay"],
                   overrides=["addon.replay.fraction=0.5"])
    assert [(a.name, a.params.get("fraction", a.params.get("weight"))) for a in run.addons] == [
        ("replay", 0.5), ("lwf", 0.5), ("ewc", None)]
    assert run.suite.content_hash() == run_spec("smoke", "sft").suite.content_hash()
    suite.write_text(smoke + "addons: [{name: lwf, params: {wieght: 1}}, replya]\n")
    res = CliRunner().invoke(cli, ["validate", str(suite)])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    line = smoke.count("\n") + 1  # the appended line, named with the column of each entry
    assert f"{suite}: addons[0].wieght (line {line}, column 10): unknown field" in text
    assert f"{suite}: addons[1] (line {line}, column 44): unknown add-on 'replya'" in text


def test_a_method_that_trains_without_the_loop_refuses_addons(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--out", str(tmp_path / "run"), "--addon", "replay"])
    assert res.exit_code == 2
    assert "the method 'test.echo-sft' trains a stage without clbench's training loop (it " \
        "overrides train_stage), so the add-ons 'replay' cannot act on it" in \
        " ".join(res.output.split())


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_replay_lowers_the_forgetting_of_stage_1_where_sft_forgets(tmp_path: Path) -> None:
    """The echo stream: stage 1 answers 3, stage 2 answers 7 to prompts that differ by one
    character. SFT forgets stage 1 entirely; with half of each stage-2 step replayed from stage
    1's items the model keeps most of it while learning stage 2."""
    suite = write_suite(tmp_path, SUITE.replace("eval_size: 6", "eval_size: 24")
                        .replace("steps: 8", "steps: 32"))
    common = ["run", "--suite", str(suite), "--method", "sft", "--device", "cpu",
              "--no-base-cache", "--set", "method.lr=1e-2"]
    scores = {}
    for name, extra in (("sft", []), ("replay", ["--addon", "replay", "--set",
                                                  "addon.replay.fraction=0.5"])):
        res = run_cli([*common, *extra, "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        result = read_results(tmp_path / name / "results.json")
        scores[name] = (result.score_matrix(), result.metrics["forgetting"].value)
    (sft_r, sft_forgetting), (replay_r, replay_forgetting) = scores["sft"], scores["replay"]
    assert sft_r[1][0] == replay_r[1][0] == 1.0  # stage 1 learned alike (no buffer yet)
    assert sft_r[2][0] == 0.0 and sft_forgetting == 1.0  # SFT forgets it all
    assert replay_r[2][1] >= 0.9  # replay still learns stage 2...
    assert replay_r[2][0] >= 0.6 and replay_forgetting <= 0.4  # ... and keeps most of stage 1
    recorded = read_results(tmp_path / "replay" / "results.json")
    assert recorded.entry_name() == "sft+replay"
    assert [a.config["fraction"] for a in recorded.addons] == [0.5]
    assert recorded.stages[1].summary["replayed_fraction"] == 0.5


def test_replayed_items_are_rolled_out_and_graded_by_their_own_task(tmp_path: Path) -> None:
    """An on-policy method with replay: the stage-1 items in a stage-2 batch are graded by the
    stage-1 task (here one that gives every completion 1), the others by the stage's own."""

    class Pass(LowercaseTask):
        def grade(self, example, completion):
            return Grade(1.0, True)

    model, tok = tiny()
    (replay,) = addons(("replay", {"fraction": 0.5, "buffer_per_stage": 8}))
    first = stage(tmp_path, model, tok, [replay], steps=1, name="first")
    first.task = Pass({"k": 8})
    with one_thread():
        GRPO().train_stage(first)
    assert {e.metadata[STAGE_KEY] for e in replay.buffer} == {"first"}
    second = stage(tmp_path, model, tok, [replay], seed=1, steps=1, name="second")
    second.tasks = {"first": first.task, "second": second.task}
    loop = TrainingLoop(second, GRPO().config, GRPO().hooks(second))
    with one_thread():
        batch, _ = loop.new_batch(0)
    replayed = [i for i in range(batch.size) if batch.example_of(i).metadata[STAGE_KEY] == "first"]
    assert len(replayed) == batch.size // 2  # 2 of the step's 4 prompts, 4 samples each
    for i, grade in enumerate(batch.grades):
        example = batch.example_of(i)
        expected = (first.task if i in replayed else second.task).grade(
            example, batch.rollouts[i].text)
        assert grade == expected
    assert {batch.grades[i].reward for i in replayed} == {1.0}


def test_replay_state_survives_a_checkpoint() -> None:
    (replay,) = addons("replay")
    task = LowercaseTask({"k": 4})
    replay.buffer = task.examples("train", 0, 3)
    (restored,) = addons("replay")
    restored.load_state_dict(copy.deepcopy(replay.state_dict()))
    assert restored.buffer == replay.buffer


# ---------------------------------------------------------------------------------------------
# EWC
# ---------------------------------------------------------------------------------------------

def _fisher_distance(ewc: Any, model: Any, anchor: dict[str, torch.Tensor],
                     fisher: dict[str, torch.Tensor]) -> float:
    return sum(float((fisher[n] * (p.detach() - anchor[n]).pow(2)).sum())
               for n, p in model.named_parameters())


def test_ewc_keeps_the_important_weights_near_those_after_the_earlier_stage(tmp_path: Path
                                                                         ) -> None:
    """What EWC claims: the Fisher-weighted distance sum F (theta - theta*)^2 from the weights
    after stage 1 stays far smaller than without the penalty. (Weights with no Fisher move as
    without it: Adam moves every weight with a gradient by about lr per step.)"""
    moved, penalties = {}, {}
    for strength in (0.0, 100.0):
        model, tok = tiny()
        (ewc,) = addons(("ewc", {"strength": strength, "fisher_items": 8}))
        sft = SFT({"lr": 1e-2})
        with one_thread():
            sft.train_stage(stage(tmp_path, model, tok, [ewc]))
        assert len(ewc.anchor) == len(list(model.parameters()))
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        fisher = {n: f.clone() for n, f in ewc.fisher.items()}
        with one_thread():
            report = sft.train_stage(stage(tmp_path, model, tok, [ewc], seed=1, k=4))
        moved[strength] = _fisher_distance(ewc, model, anchor, fisher)
        penalties[strength] = [r.get("ewc_penalty", 0.0) for r in report.steps]
    assert penalties[0.0] == [0.0] * 6
    assert penalties[100.0][0] == 0.0 < penalties[100.0][-1]  # at the anchor, then away
    assert moved[100.0] < 0.2 * moved[0.0], moved


def test_ewc_penalty_is_strength_half_the_fisher_weighted_distance(tmp_path: Path) -> None:
    """The term a step adds, against a hand computation, split evenly over micro-batches."""
    model, tok = tiny()
    (ewc,) = addons(("ewc", {"strength": 3.0}))
    params = dict(model.named_parameters())
    ewc.anchor = {n: p.detach() + 0.01 for n, p in params.items()}
    ewc.fisher = {n: torch.full_like(p, 2.0) for n, p in params.items()}
    expected = 0.5 * 3.0 * sum(2.0 * 0.01 ** 2 * p.numel() for p in params.values())
    ctx = stage(tmp_path, model, tok, [ewc])
    config = SFTConfig(micro_batch_size=2)
    loop = TrainingLoop(ctx, config, SFTHooks(config, ctx))
    batch, _ = loop.new_batch(0)
    parts = loop.hooks.micro_batches(batch)
    assert len(parts) == 2
    term, stats = ewc.loss_term(loop, batch, parts[0])
    assert float(term.detach()) == pytest.approx(expected / 2, rel=1e-4)
    assert stats["ewc_penalty"] == pytest.approx(expected / 2, rel=1e-4)


def test_ewc_without_strength_is_the_method_alone_and_its_state_outlives_a_checkpoint(
        tmp_path: Path) -> None:
    losses = []
    for attached in ([], addons(("ewc", {"strength": 0.0}))):
        model, tok = tiny()
        with one_thread():
            report = SFT({"lr": 1e-2}).train_stage(stage(tmp_path, model, tok, attached, steps=4))
        losses.append([r["loss"] for r in report.steps])
    assert losses[0] == losses[1]
    (restored,) = addons("ewc")
    restored.load_state_dict(copy.deepcopy(attached[0].state_dict()))
    assert restored.fisher.keys() == attached[0].fisher.keys()
    assert all(torch.equal(restored.anchor[n], attached[0].anchor[n]) for n in restored.anchor)


# ---------------------------------------------------------------------------------------------
# LwF
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("topk", [None, 5])
def test_lwf_adds_the_kl_from_the_stage_start_model_at_its_temperature(tmp_path: Path,
                                                                       topk: int | None) -> None:
    """The term of a micro-batch, by hand: the token mean (over the step's completion tokens) of
    KL(start / T || student / T), times the weight; over the start model's top k plus a tail
    bucket when `topk` is set."""
    model, tok = tiny(seed=0)
    (lwf,) = addons(("lwf", {"weight": 0.7, "temperature": 2.0, "topk": topk}))
    ctx = stage(tmp_path, model, tok, [lwf])
    config = SFTConfig(micro_batch_size=2)
    loop = TrainingLoop(ctx, config, SFTHooks(config, ctx))
    lwf.on_stage_start(loop)
    with torch.no_grad():  # the student moves away from the stage's start
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch, _ = loop.new_batch(0)
    parts = loop.hooks.micro_batches(batch)
    term, stats = lwf.loss_term(loop, batch, parts[0])

    prompts, completions = loop.hooks.part_sequences(batch, parts[0])
    total = sum(len(c) for p in parts for c in loop.hooks.part_sequences(batch, p)[1])
    kl_sum = 0.0
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        rows = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
        with torch.no_grad():
            q = torch.log_softmax(lwf.start(input_ids=ids).logits[0, rows].float() / 2.0, -1)
            p = torch.log_softmax(model(input_ids=ids).logits[0, rows].float() / 2.0, -1)
        if topk is not None:  # the start model's top k, the rest of each side in one bucket
            index = q.topk(topk, dim=-1).indices
            q, p = (torch.cat([x.gather(-1, index), torch.log1p(-x.gather(-1, index).exp()
                                                                 .sum(-1, keepdim=True))], -1)
                    for x in (q, p))
        kl_sum += float((q.exp() * (q - p)).sum())
    assert float(term.detach()) == pytest.approx(0.7 * kl_sum / total, rel=1e-4)
    assert stats["lwf_kl"] == pytest.approx(kl_sum / total, rel=1e-4)
    assert float(term.detach()) > 0
    term.backward()  # its gradient reaches the student
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_lwf_holds_the_student_near_the_stage_start_model(tmp_path: Path) -> None:
    """After a stage with LwF, the student's KL from its stage-start self on the stage's own
    items is smaller than after the same stage without it."""
    kls = {}
    for weight in (0.0, 5.0):
        model, tok = tiny()
        (lwf,) = addons(("lwf", {"weight": weight, "temperature": 1.0}))
        start = copy.deepcopy(model)
        ctx = stage(tmp_path, model, tok, [lwf], steps=8)
        with one_thread():
            SFT({"lr": 1e-2}).train_stage(ctx)
        hooks = SFTHooks(SFTConfig(), ctx)
        pairs = [hooks.encode(e) for e in ctx.train_examples[:8]]
        kl = 0.0
        with torch.no_grad():
            for prompt, response in pairs:
                ids = torch.tensor([prompt + response])
                rows = slice(len(prompt) - 1, len(prompt) + len(response) - 1)
                q = torch.log_softmax(start(input_ids=ids).logits[0, rows], -1)
                p = torch.log_softmax(model(input_ids=ids).logits[0, rows], -1)
                kl += float((q.exp() * (q - p)).sum(-1).mean())
        kls[weight] = kl
        assert lwf.start is None  # dropped at the stage's end
    assert kls[5.0] < 0.5 * kls[0.0], kls


# ---------------------------------------------------------------------------------------------
# Merge, and composition
# ---------------------------------------------------------------------------------------------

def test_merge_interpolates_the_trained_weights_with_the_stage_start(tmp_path: Path) -> None:
    trained = {}
    for attached in ([], addons(("merge", {"alpha": 0.25}))):
        model, tok = tiny()
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        with one_thread():
            report = SFT({"lr": 1e-2}).train_stage(stage(tmp_path, model, tok, attached))
        trained[bool(attached)] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert report.extra["merge"] == {"alpha": 0.25}
    for name, merged in trained[True].items():
        expected = 0.75 * start[name] + 0.25 * trained[False][name]
        torch.testing.assert_close(merged, expected)
    assert any(not torch.equal(start[n], trained[False][n]) for n in start)


def test_two_addons_compose_in_the_order_listed(tmp_path: Path) -> None:
    """merge then ewc: EWC anchors the merged weights; ewc then merge: the weights before the
    merge (which then moves them away from the anchor)."""
    anchors = {}
    for order in (("merge", "ewc"), ("ewc", "merge")):
        model, tok = tiny()
        attached = addons(*order)
        with one_thread():
            SFT({"lr": 1e-2}).train_stage(stage(tmp_path, model, tok, attached))
        ewc = attached[order.index("ewc")]
        final = dict(model.named_parameters())
        anchors[order] = all(torch.equal(ewc.anchor[n], final[n].detach()) for n in ewc.anchor)
    assert anchors == {("merge", "ewc"): True, ("ewc", "merge"): False}


def test_report_and_comparison_key_an_entry_by_method_and_addons(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    common = ["run", "--suite", str(suite), "--method", "sft", "--device", "cpu"]
    for name, extra in (("plain", []), ("replay", ["--addon", "replay"]),
                        ("replay-half", ["--addon", "replay", "--set",
                                         "addon.replay.fraction=0.5"])):
        assert run_cli([*common, *extra, "--out", str(tmp_path / "runs" / name)]).exit_code == 0
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "runs"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    (labels,) = data["comparison"].values()
    assert sorted(labels) == ["sft", "sft+replay (replay.fraction=0.25)",
                              "sft+replay (replay.fraction=0.5)"]
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "runs" / "replay-half")])
    assert "method settings: sft's defaults; replay: fraction=0.5" in " ".join(res.output.split())


@pytest.mark.e2e
@pytest.mark.parametrize("method, addon", [("grpo", "replay"), ("sdpo", "ewc"), ("sft", "lwf")])
def test_an_addon_runs_the_smoke_suite_with_any_method_and_is_recorded(
        tmp_path: Path, method: str, addon: str) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method, "--addon", addon,
                                   "--out", str(out), "--no-base-cache"])
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.status == "complete" and result.entry_name() == f"{method}+{addon}"
    (recorded,) = result.addons
    defaults = registry.load_addon_class(addon).Config().model_dump(mode="json")
    assert (recorded.name, recorded.config, recorded.distribution) == (addon, defaults, "clbench")
    identity = json.loads((out / "run.json").read_text())
    assert identity["addons"] == [{"name": addon, "params": defaults}]


def test_lwf_with_a_method_whose_batches_give_no_token_ids_says_so(tmp_path: Path) -> None:
    from clbench.api import UserError

    class Opaque(SFTHooks):  # a third party's hooks without part_sequences
        part_sequences = StepHooksBase.part_sequences

    model, tok = tiny()
    (lwf,) = addons("lwf")
    ctx = stage(tmp_path, model, tok, [lwf], steps=1)
    with pytest.raises(UserError, match=r"the method's step hooks \(Opaque\) do not give their "
                                        r"batches' token ids"):
        TrainingLoop(ctx, SFTConfig(), Opaque(SFTConfig(), ctx)).run()
