"""`clbench run --plan --estimate`: the projection from measured costs, the calibration batch,
and the command on the smoke suite (nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from clbench.cli import cli
from clbench.run.estimate import ColumnCost, RunEstimate, StageCost, middle_batch, state_bytes
from clbench.tasks.base import Example


def test_a_run_costs_every_row_its_columns_batches_and_every_stage_its_steps() -> None:
    estimate = RunEstimate(
        rows=4, columns=(ColumnCost("math", 100, 16, 2.0), ColumnCost("tool", 32, 16, 10.0)),
        stages=(StageCost("math", 16, 3.0), StageCost("tool", 8, 12.5)),
        stage_checkpoint_bytes=1_000, step_checkpoint_bytes=3_000, not_estimated=("general",))
    # math: 100 / 16 = 6.25 batches x 2 s; tool: 2 x 10 s; 4 rows
    assert estimate.eval_seconds == pytest.approx(4 * (12.5 + 20.0))
    assert estimate.train_seconds == pytest.approx(16 * 3.0 + 8 * 12.5)
    assert estimate.seconds == pytest.approx(130.0 + 148.0)
    assert estimate.disk_bytes == 7_000  # the last stage's, the latest step's and its successor
    with_diagnostics = RunEstimate(rows=2, columns=(), stages=(StageCost("math", 1, 1.0),),
                                   stage_checkpoint_bytes=0, step_checkpoint_bytes=0,
                                   diagnostics_seconds=30.0, base_weights_bytes=500)
    assert with_diagnostics.seconds == 31.0 and with_diagnostics.disk_bytes == 500


def test_the_calibration_batch_holds_the_prompts_around_the_median_length() -> None:
    items = [Example(str(i), [{"role": "user", "content": "x" * i}], "", None)
             for i in range(100)]
    batch = middle_batch(items, 4, lambda ex: len(ex.messages[0]["content"]))
    assert [ex.id for ex in batch] == ["51", "50", "49", "48"]  # longest first, as a run
    assert middle_batch(items[:3], 4, lambda ex: int(ex.id)) == [items[2], items[1], items[0]]


def test_state_bytes_counts_every_tensor_of_a_nested_state() -> None:
    import torch

    state = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3, 4),
                                         "exp_avg_sq": torch.zeros(3, 4), "step": 5}}},
             "teacher": [torch.zeros(10, dtype=torch.bfloat16)], "note": "x"}
    assert state_bytes(state) == 2 * 12 * 4 + 10 * 2


@pytest.mark.e2e
def test_plan_estimate_calibrates_on_the_smoke_suite_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "grpo", "--out",
                                      str(out), "--plan", "--estimate"],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert "estimate on this machine cpu, " in text
    rows = {line.split()[1]: line.split() for line in text.splitlines()
            if line.strip().startswith(("eval ", "train "))}
    assert rows["math_ood"][2:6] == ["3", "rows", "x", "8"]  # 3 rows x 8 items
    assert rows["science"][2:5] == ["2", "steps", "x"]
    assert any(line.split()[:1] == ["diagnostics"] for line in text.splitlines())
    # a step checkpoint holds AdamW's two moments besides the weights: about 3x a stage's
    disk = next(line for line in text.splitlines() if line.startswith("disk"))
    assert "two of the stage in progress" in disk
    assert "total" in text and "disk checkpoints at most" in text and "MiB" in text
    assert not out.exists()


@pytest.mark.e2e
def test_a_joint_run_is_estimated_from_the_stages_own_items(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--joint",
                                      "--out", str(tmp_path / "j"), "--plan", "--estimate"],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    train = [line.split() for line in result.output.splitlines()
             if line.strip().startswith("train ")]
    assert [row[:4] for row in train] == [["train", "joint", "4", "steps"]]  # 2 + 2 stage steps
    assert "2 rows x 8 items" in result.output  # row 0 and the joint row
    assert not (tmp_path / "j").exists()


@pytest.mark.e2e
def test_estimate_goes_with_plan() -> None:
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft",
                                      "--estimate"])
    assert result.exit_code == 2 and "--estimate goes with --plan" in result.output
