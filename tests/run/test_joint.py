"""The joint (multi-task) reference: `clbench run --joint` trains one stage on every stream task
at once, and `clbench report` turns its scores into the intransigence of the continual runs of
the same setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import SUITE, run_cli, write_suite

from clbench.report.intransigence import add_intransigence
from clbench.results import read_results
from clbench.run.joint import PART_KEY, MixedTasks, mixed_train_set
from clbench.spec.options import RunSettings
from clbench.spec.schema import Budget, StageSpec, TaskSpec, joint_stage
from clbench.tasks.math.generated import Arithmetic
from clbench.tasks.science.generated import Facts

pytestmark = pytest.mark.e2e  # a suite run end to end


def _stage(name: str, **budget: object) -> StageSpec:
    return StageSpec(name=name, task=TaskSpec(source="x", train_size=10),
                     budget=Budget(**{"steps": 3, **budget}))


def test_the_joint_stage_sums_steps_and_refuses_budgets_that_disagree() -> None:
    stage = joint_stage([_stage("a", max_new_tokens=48), _stage("b", steps=5, max_new_tokens=64)])
    assert (stage.name, stage.budget.steps, stage.budget.max_new_tokens) == ("joint", 8, 64)
    assert stage.task.train_size == 20 and stage.task.params == {"stages": ["a", "b"]}
    with pytest.raises(ValueError, match=r"agree on `budget.prompts_per_step` \(a: 4, b: 2\)"):
        joint_stage([_stage("a"), _stage("b", prompts_per_step=2)])


def test_mixed_items_keep_their_task_for_grading_and_answers() -> None:
    math, science = Arithmetic({"digits": 1}), Facts({"families": ["symbol"]})
    sets = [math.examples("train", 1, 6), science.examples("train", 2, 6)]
    mixed = mixed_train_set(sets, [1, 2])
    assert mixed == mixed_train_set(sets, [1, 2])  # the same order every time
    assert mixed != mixed_train_set(sets, [1, 3])  # ... drawn from the data seeds
    assert sorted(e.id for e in mixed) == sorted(e.id for s in sets for e in s)
    assert [e.metadata[PART_KEY] for e in mixed].count(0) == 6
    assert [e.metadata[PART_KEY] for e in mixed][:6] not in ([0] * 6, [1] * 6)  # interleaved
    task = MixedTasks([math, science])
    text = "2+2 is 4, so\nThe answer is \\boxed{4}.\nDone"
    assert math.answer_start(text) == 13 and science.answer_start(text) == 38  # they differ
    for example in mixed:  # each item is graded by its own task: its reference is correct
        assert task.grade(example, example.reference).correct
        own = [math, science][example.metadata[PART_KEY]]
        assert task.answer_start_for(example)(text) == own.answer_start(text)
    with pytest.raises(TypeError, match="answer_start_for"):  # no one answer format: refused
        task.answer_start(text)
    with pytest.raises(TypeError, match="the stages' own"):  # nor items of its own
        task.examples("train", 0, 4)


def test_rollouts_of_mixed_items_keep_their_own_stage_token_cap(tmp_path: Path) -> None:
    """The joint stage's budget has the longest cap; each item is still sampled under its own
    stage's, so the joint model gets no more tokens per item than the continual runs."""
    from toy import FixedGenerator, LowercaseTask, RowNLL, one_thread, tiny, toy_context

    from clbench.train.loop import TrainingLoop
    from clbench.train.onpolicy import OnPolicySettings

    short, long = LowercaseTask({"k": 2}), LowercaseTask({"k": 8})
    mixed = mixed_train_set([short.examples("train", 1, 8), long.examples("train", 2, 8)], [1, 2])
    task = MixedTasks([short, long], max_new_tokens=[2, 8])
    assert [task.max_new_tokens_for(e) for e in mixed] == [
        [2, 8][e.metadata[PART_KEY]] for e in mixed]
    assert MixedTasks([short, long]).max_new_tokens_for(mixed[0]) is None  # the stage's cap
    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=8, samples_per_prompt=2,
                      max_new_tokens=8)
    ctx.task, ctx.train_examples = task, mixed
    settings = OnPolicySettings(lr=1e-3)
    loop = TrainingLoop(ctx, settings, RowNLL(ctx, lambda e: True))
    with one_thread():
        batch, _ = loop.new_batch(0)
    lengths: dict[int, set[int]] = {0: set(), 1: set()}
    for i, rollout in enumerate(batch.rollouts):
        lengths[batch.example_of(i).metadata[PART_KEY]].add(len(rollout.completion_ids))
    assert (max(lengths[0]), max(lengths[1])) == (2, 8)  # each reaches its own cap, no more
    # a generation backend that ignores the caps is caught, not trained on
    ignoring = TrainingLoop(ctx, settings, RowNLL(ctx, lambda e: True,
                                                  generator=FixedGenerator(tok)))
    with one_thread(), pytest.raises(RuntimeError, match="for a prompt capped at 2"):
        ignoring.new_batch(0)


def test_a_joint_run_is_the_reference_of_report_intransigence(tmp_path: Path) -> None:
    suite = write_suite(tmp_path)  # 8 steps a stage: the echo method learns each digit
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu"]
    runs = tmp_path / "runs"
    for seed in (0, 1):
        assert run_cli([*common, "--seed", str(seed), "--out",
                        str(runs / "echo" / f"s{seed}")]).exit_code == 0
    res = run_cli([*common, "--joint", "--out", str(runs / "echo-joint" / "s0")])
    assert res.exit_code == 0, res.output
    joint = read_results(runs / "echo-joint" / "s0" / "results.json")
    assert joint.joint and joint.status == "complete" and joint.metrics == {}
    assert joint.row_labels == ["base", "after joint"]
    assert [c.name for c in joint.columns] == ["low", "high", "all"]  # the suite's columns
    report = json.loads((runs / "echo-joint" / "s0" / "stages" / "stage1.json").read_text())
    assert len(report["steps"]) == 16  # the stages' 8 + 8 steps
    # its folder is its own: a stage-by-stage run is refused there, the joint run resumes
    res = run_cli([*common, "--out", str(runs / "echo-joint" / "s0"), "--resume"])
    assert res.exit_code == 2 and "holds another run (joint: true there, (absent) now)" in \
        " ".join(res.output.split())
    res = run_cli([*common, "--joint", "--out", str(runs / "echo-joint" / "s0"), "--resume"])
    assert res.exit_code == 0 and "after joint" in res.output

    from clbench.report.runs import collect_results
    from clbench.report.runs import report as print_report

    found = collect_results([runs])
    add_intransigence(found)
    a_star = [c.score for c in joint.matrix[1][:2]]
    for _, r in found:
        if r.joint:
            continue
        R = r.score_matrix()
        expected = [a_star[0] - R[1][0], a_star[1] - R[2][1]]
        assert any(v != 0 for v in expected)  # the joint model differs from the stream's
        m = r.metrics["intransigence"]
        assert m.per_stage == pytest.approx(expected)
        assert m.value == pytest.approx(sum(expected) / 2)
        assert m.variant == "joint reference (n=1)" and not m.higher_is_better
    # the report pairs them itself; the joint run is no contender in the comparison
    from rich.console import Console

    data = print_report([runs], as_json=True, console=Console(record=True))
    (suite_rows,) = data["comparison"].values()
    assert list(suite_rows) == ["test.echo-sft"]  # two seeds, the joint run not among them
    assert suite_rows["test.echo-sft"]["intransigence"]["n"] == 2
    (joint_entry,) = [r for r in data["runs"] if r["dir"].endswith("echo-joint/s0")]
    assert joint_entry["joint"] is True

    # a second joint seed: a* is the mean over both; the same run named twice counts once
    assert run_cli([*common, "--joint", "--seed", "1", "--out",
                    str(runs / "echo-joint" / "s1")]).exit_code == 0
    joints = [read_results(runs / "echo-joint" / f"s{s}" / "results.json") for s in (0, 1)]
    a_star = [(joints[0].matrix[1][k].score + joints[1].matrix[1][k].score) / 2 for k in (0, 1)]
    found = collect_results([runs, runs / "echo-joint" / "s0"])
    add_intransigence(found)
    for _, r in found:
        if not r.joint:
            R = r.score_matrix()
            assert r.metrics["intransigence"].per_stage == pytest.approx(
                [a_star[0] - R[1][0], a_star[1] - R[2][1]])
            assert r.metrics["intransigence"].variant == "joint reference (n=2)"

    # a joint run of another method setting is not a reference
    other = run_cli([*common, "--joint", "--set", "method.lr=0.5", "--out",
                     str(tmp_path / "other" / "s0")])
    assert other.exit_code == 0, other.output
    found = collect_results([runs / "echo", tmp_path / "other"])
    add_intransigence(found)
    assert all(r.metrics.get("intransigence") is None or r.metrics["intransigence"].value is None
               for _, r in found)


@pytest.mark.parametrize("method", ["grpo", "sdpo"])
def test_on_policy_methods_train_a_joint_stage(tmp_path: Path, method: str) -> None:
    """Rollouts of mixed items are graded by their own tasks, and SDPO finds each answer with
    its own task (the mixture itself refuses to)."""
    out = tmp_path / "r"
    res = run_cli(["run", "--suite", "smoke", "--method", method, "--joint", "--device", "cpu",
                   "--no-base-cache", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.joint and result.status == "complete" and len(result.matrix) == 2
    steps = json.loads((out / "stages" / "stage1.json").read_text())["steps"]
    assert len(steps) == 4 and all("reward_mean" in s for s in steps)
    assert result.stages[0].counters["rollouts"] == 4 * 2 * 2  # 4 steps x 2 prompts x 2 samples


def test_a_joint_run_needs_stages_that_share_a_budget(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, SUITE.replace("steps: 8, prompts_per_step: 4}\n  - name: high",
                                                "steps: 8, prompts_per_step: 2}\n  - name: high"))
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--joint",
                   "--device", "cpu", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "--joint: a joint run trains every stage's task in one stage with one budget, so the " \
        "stages must agree on `budget.prompts_per_step` (low: 2, high: 4)" in \
        " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


def test_a_sweep_of_joint_references_gives_the_grid_its_intransigence(tmp_path: Path) -> None:
    root = tmp_path / "grid"
    common = ["sweep", "--suite", "smoke", "--methods", "sft", "--seeds", "0", "--device", "cpu",
              "--out", str(root)]
    res = run_cli(common)
    assert res.exit_code == 0, res.output
    assert "intransig" not in res.output.split("mean ± std")[-1]  # no reference yet
    from rich.console import Console

    from clbench.sweep.grid import sweep

    # as a child process (--jobs 2): `--joint` reaches it
    data = sweep("smoke", ["sft"], [0], root, RunSettings(device="cpu", joint=True), jobs=2,
                 console=Console(record=True, width=250))
    joint = read_results(root / "sft-joint" / "s0" / "results.json")
    assert joint.joint and joint.status == "complete"
    assert (root / "logs" / "sft-joint-s0.log").is_file()
    (suite_rows,) = data.values()  # the stage-by-stage run, with its reference
    assert list(suite_rows) == ["sft"] and suite_rows["sft"]["intransigence"]["n"] == 1
