"""Devices, precision and processes (clbench/engine/distributed.py): prompt and item sharding,
mixed precision on CPU, and a two-process run of the smoke suite through `accelerate launch`."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from toy import one_thread, toy_context

from clbench.engine.distributed import Distributed, eval_share, resolve_precision
from clbench.engine.optim import rank_share, step_examples
from clbench.errors import UserError
from clbench.models import load_model
from clbench.results import read_results

# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------


def test_rank_share_gives_each_rank_a_contiguous_equal_slice() -> None:
    items = list("abcdefgh")
    assert rank_share(items, 0, 1) == items
    assert [rank_share(items, r, 2) for r in range(2)] == [list("abcd"), list("efgh")]
    assert [rank_share(items, r, 4) for r in range(4)] == [list("ab"), list("cd"), list("ef"),
                                                           list("gh")]
    assert rank_share(items, 7, 8) == ["h"]


def test_rank_share_refuses_a_step_that_does_not_divide() -> None:
    with pytest.raises(UserError) as err:
        rank_share(list(range(6)), 0, 4, "math")
    message = str(err.value)
    assert "stage 'math'" in message and "prompts_per_step 6" in message
    assert "4 processes" in message


def test_step_examples_shares_concatenate_to_the_single_process_step() -> None:
    items = [f"item{i}" for i in range(10)]
    for step in range(4):
        whole = step_examples(items, 4, step, seed=3)
        shares = [step_examples(items, 4, step, seed=3, rank=r, world=2) for r in range(2)]
        assert shares[0] + shares[1] == whole


def test_eval_share_splits_items_in_order_with_sizes_within_one() -> None:
    for n, world in [(8, 2), (7, 2), (5, 3), (2, 4), (0, 2)]:
        shares = [eval_share(n, r, world) for r in range(world)]
        assert [i for s in shares for i in s] == list(range(n))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


def test_precision_resolution_and_fp16_refusal() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("float32", True, cpu).label == "fp32"
    mixed = resolve_precision("bfloat16", True, cpu)
    assert (mixed.weights, mixed.compute, mixed.label) == (torch.float32, torch.bfloat16,
                                                           "bf16-mixed")
    assert resolve_precision("bfloat16", False, cpu).label == "bf16"
    with pytest.raises(UserError, match="float16 cannot be trained"):
        resolve_precision("float16", True, cpu)


def _one_grpo_step(tmp_path: Path, mixed_precision: bool) -> tuple[float, set[torch.dtype]]:
    """One GRPO step at lr 1e-6 with bf16 compute; (fraction of weights changed, dtypes of the
    MLP outputs seen during training)."""
    from clbench_methods.grpo import GRPO

    dist = Distributed.create("cpu", "bfloat16", mixed_precision)
    model, tok = load_model("tiny-llama", device="cpu", dtype=dist.precision.weights, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    ctx = toy_context(model, tok, tmp_path, steps=1, lr=1e-6)
    ctx = dataclasses.replace(ctx, dist=dist, train_model=None)  # prepared by __post_init__
    seen: set[torch.dtype] = set()
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: seen.add(out.dtype))
    with one_thread():
        report = GRPO({"lr": 1e-6}).train_stage(ctx)
    hook.remove()
    assert report.steps[0]["grad_norm"] > 0  # the toy task has a learning signal at step one
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    return changed / sum(b.numel() for b in before), seen


def test_mixed_precision_keeps_small_updates_that_bf16_weights_lose(tmp_path: Path) -> None:
    fraction, seen = _one_grpo_step(tmp_path / "mixed", mixed_precision=True)
    assert seen == {torch.bfloat16}  # every forward (rollouts and training) was autocast
    assert fraction > 0.9, fraction  # fp32 master weights: a 1e-6 step moves nearly every one
    # The contrast: weights stored in bf16 round the same update away almost everywhere.
    fraction_bf16, seen_bf16 = _one_grpo_step(tmp_path / "bf16", mixed_precision=False)
    assert seen_bf16 == {torch.bfloat16}
    assert fraction_bf16 < 0.1, fraction_bf16


# ---------------------------------------------------------------------------------------------
# Two processes through the CLI
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch` N CPU processes (torchrun-style, gloo) running `clbench`."""
    accelerate = Path(sys.executable).with_name("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "clbench.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


SMALL = ["--set", "protocol.bootstrap_samples=20"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "sdpo", "sft"])
def test_two_process_smoke_run_matches_one_process_row_0(tmp_path: Path, method: str) -> None:
    from clbench.cli import cli

    single = tmp_path / "single"
    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method, "--device",
                                   "cpu", "--out", str(single), *SMALL], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = tmp_path / "two"
    proc = _launch(["run", "--suite", "smoke", "--method", method, "--device", "cpu", "--out",
                    str(out), *SMALL])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("method config") == 1  # only the main process prints
    result = read_results(out / "results.json")
    assert result.status == "complete" and len(result.matrix) == 3
    assert all(cell is not None and cell.n == 8 for row in result.matrix for cell in row)
    assert result.model.resolved["num_processes"] == 2
    assert result.model.resolved["precision"] == "fp32"
    one = read_results(single / "results.json")
    assert one.model.resolved["num_processes"] == 1
    # Row 0 (same model, items split over the ranks and gathered back in order) is the
    # single-process row, item by item.
    assert result.matrix[0] == one.matrix[0]
    for column in ("math", "science", "math_ood"):
        path = Path("items") / "row0" / f"{column}.jsonl"
        assert (out / path).read_text() == (single / path).read_text()
    # one set of files: what a single-process run writes, nothing per rank
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(single)) for p in single.rglob("*")
                           if p.is_file())
    for i in (1, 2):
        stage = json.loads((out / "stages" / f"stage{i}.json").read_text())
        alone = json.loads((single / "stages" / f"stage{i}.json").read_text())
        # counters are summed over the ranks (2 steps x 2 prompts x 2 samples in all), the
        # optimizer steps are the ranks' common ones
        assert stage["counters"]["optimizer_steps"] == alone["counters"]["optimizer_steps"] == 2
        assert stage["counters"]["prompts"] == alone["counters"]["prompts"] == 4
        assert stage["counters"]["rollouts"] == alone["counters"]["rollouts"] == \
            (0 if method == "sft" else 8)
        assert [s["step"] for s in stage["steps"]] == [1, 2]
    assert (out / "run.log").read_text().count("stage 1 step") == 2


@pytest.mark.slow
def test_two_processes_refuse_prompts_per_step_that_does_not_divide(tmp_path: Path) -> None:
    proc = _launch(["run", "--suite", "smoke", "--method", "grpo", "--device", "cpu", "--out",
                    str(tmp_path / "r"), "--set", "stages[1].budget.prompts_per_step=3"])
    assert proc.returncode != 0
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "stage 'science': prompts_per_step 3 is not divisible by the 2 processes" in text
    assert not (tmp_path / "r" / "results.json").exists()
