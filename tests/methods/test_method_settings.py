"""A suite's per-method settings (`methods:`): applied to their method only, validated with their
path, beaten by `--set method.X`, kept out of the suite's hash, recorded and reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import run_spec
from where import SMOKE

from clbench.cli import cli
from clbench.plugins import registry
from clbench.plugins.runspec import validate_suite_plugins
from clbench.spec.reading import SpecError
from clbench.spec.suites import load_suite

SMOKE = SMOKE


def _suite(tmp_path: Path, methods: str, name: str = "smoke-settings.yaml") -> Path:
    """The smoke suite with `methods` as its `methods:` block (its own block left out)."""
    path = tmp_path / name
    smoke = SMOKE.read_text(encoding="utf-8").split("\nmethods:\n")[0] + "\n"
    path.write_text(smoke + methods, encoding="utf-8")
    return path


BLOCK = """\
methods:
  sdpo: {lr: 3.0e-6, feedback: format}
  grpo: {lr: 2.0e-6}
"""


def _defaults(method: str, **settings: object) -> dict:
    """`method`'s whole config at its defaults, but for `settings`: what a run records."""
    return registry.validate_method_params(method, settings).model_dump(mode="json")


def test_a_block_applies_to_its_method_only(tmp_path: Path) -> None:
    path = _suite(tmp_path, BLOCK)
    assert run_spec(path, "sdpo").method.params == _defaults("sdpo", lr=3e-6, feedback="format")
    assert run_spec(path, "grpo").method.params == _defaults("grpo", lr=2e-6)
    assert run_spec(path, "sft").method.params == _defaults("sft")  # no block: the defaults
    # sdpo-cot is another method: sdpo's block does not reach it
    assert run_spec(path, "sdpo-cot").method.params == _defaults("sdpo-cot")


def test_set_method_wins_over_the_block_and_keeps_its_other_fields(tmp_path: Path) -> None:
    run = run_spec(_suite(tmp_path, BLOCK), "sdpo", overrides=["method.lr=1e-4"])
    assert run.method.params == _defaults("sdpo", lr=1e-4, feedback="format")


@pytest.mark.parametrize("block, message", [
    ("methods:\n  sdpo: {lr: -1}\n", "methods.sdpo.lr: Input should be greater than 0"),
    ("methods:\n  sdpo: {learning_rate: 1.0e-5}\n", "methods.sdpo.learning_rate: unknown field"),
    ("methods:\n  sdpo: {feedback: verbose}\n",
     "methods.sdpo.feedback: Input should be 'none', 'format' or 'rich'"),
    ("methods:\n  sdpoo: {lr: 1.0e-5}\n",
     "methods.sdpoo: unknown method 'sdpoo'. Did you mean 'sdpo' or 'sdpo-cot'?"),
])
def test_a_bad_block_is_refused_with_its_path(tmp_path: Path, block: str, message: str) -> None:
    path = _suite(tmp_path, block)
    with pytest.raises(SpecError) as info:
        validate_suite_plugins(load_suite(path), path)
    field, rest = message.split(": ", 1)
    assert f"{path}: {field} (line " in str(info.value)  # where the file says it
    assert f"): {rest}" in str(info.value)
    # a run of any method is refused alike (also one the block does not name)
    with pytest.raises(SpecError, match=message.split(":")[0]):
        run_spec(path, "grpo")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2 and f"{field} (line " in result.output
    assert rest in result.output.replace("\n", " ")


def test_the_block_is_not_part_of_the_suites_hash(tmp_path: Path) -> None:
    plain, with_block = load_suite(SMOKE), load_suite(_suite(tmp_path, BLOCK))
    assert with_block.methods["sdpo"] == {"lr": 3e-6, "feedback": "format"}
    assert with_block.content_hash() == plain.content_hash()


@pytest.mark.e2e
def test_the_settings_in_force_are_recorded_and_reported(tmp_path: Path) -> None:
    from clbench.results import read_results

    path = _suite(tmp_path, "methods:\n  sft: {lr: 3.0e-4, warmup_steps: 1}\n")
    out = tmp_path / "run"
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(cli, ["run", "--suite", str(path), "--method", "sft", "--device", "cpu",
                                 "--out", str(out), "--no-base-cache"])
    assert result.exit_code == 0, result.output
    recorded = read_results(out / "results.json").method.config
    assert (recorded["lr"], recorded["warmup_steps"]) == (3e-4, 1)
    report = runner.invoke(cli, ["report", str(out)])
    assert "method settings: lr=0.0003, warmup_steps=1" in report.output
    markdown = runner.invoke(cli, ["report", str(out), "--markdown"])
    assert "Method settings: lr=0.0003, warmup_steps=1." in markdown.output


# ---------------------------------------------------------------------------------------------
# Validation items, on which such settings are chosen
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source, params", [
    ("math.arithmetic", {"digits": 2}), ("tool_use.generated", {}),
    ("science.facts", {"families": ["symbol", "unit_conversion"]})])
def test_validation_items_are_neither_trained_on_nor_evaluation_items(source: str,
                                                                      params: dict) -> None:
    from clbench.plugins.registry import build_task
    from clbench.run.rows import column_items
    from clbench.spec.schema import TaskSpec

    spec = TaskSpec(source=source, params=params, train_size=64)
    task = build_task(spec)
    trained = {e.id for e in task.examples("train", spec.seed, spec.train_size)}
    evaluated = {e.id for e in column_items(task, spec, 40)}
    validation = column_items(task, spec, 40, "validation")
    ids = {e.id for e in validation}
    assert len(ids) == 40 and not ids & trained and not ids & evaluated
    assert column_items(task, spec, 40, "validation") == validation  # the same every time


def test_a_suite_scored_on_validation_items_plans_them_and_checks_there_are_enough(
        tmp_path: Path) -> None:
    from clbench.run.rows import plan_columns

    run = run_spec(SMOKE, "sft", overrides=["protocol.split=validation"])
    plans, _ = plan_columns(run)
    eval_run = run_spec(SMOKE, "sft")
    eval_plans, _ = plan_columns(eval_run)
    for plan, eval_plan in zip(plans, eval_plans):
        assert not {e.id for e in plan.examples} & {e.id for e in eval_plan.examples}
    assert run.suite.content_hash() != eval_run.suite.content_hash()  # another measurement
    # more validation items than the training split holds beyond train_size: refused up front
    path = _suite(tmp_path, "")
    with pytest.raises(SpecError, match=r"stages\[1\]\.task\.eval_size \(validation: 150 "
                                        r"training items after train_size\)"):
        run_spec(path, "sft", overrides=["protocol.split=validation",
                                               "stages[1].task.eval_size=150"])
