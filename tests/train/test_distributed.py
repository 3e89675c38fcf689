"""Devices, precision and processes (clbench/train/distributed.py): prompt and item sharding,
mixed precision on CPU, and a two-process run of the smoke suite through `accelerate launch`."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from toy import FixedGenerator, RowNLL, one_thread, tiny, toy_context
from where import TESTS

from clbench.errors import UserError
from clbench.models import ModelLoadError, cpu_supports_bf16, load_model
from clbench.results import read_results
from clbench.train.distributed import Distributed, eval_share, resolve_precision
from clbench.train.loop import TrainingLoop
from clbench.train.onpolicy import OnPolicySettings
from clbench.train.optim import rank_share, step_examples

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


def _one_grpo_step(tmp_path: Path, mixed_precision: bool
                   ) -> tuple[float, set[tuple[torch.dtype, bool]]]:
    """One GRPO step at lr 1e-6 with bf16 compute; (fraction of weights changed, (dtype, grad
    enabled) of the MLP outputs seen during training: rollouts without grad, training with)."""
    from clbench_methods.grpo import GRPO

    dist = Distributed.create("cpu", "bfloat16", mixed_precision)
    model, tok = load_model("tiny-llama", device="cpu", dtype=dist.precision.weights, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    # the run's Distributed goes in directly: no other Accelerator is created after it
    ctx = toy_context(model, tok, tmp_path, steps=1, lr=1e-6, dist=dist)
    seen: set[tuple[torch.dtype, bool]] = set()
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: seen.add((out.dtype, torch.is_grad_enabled())))
    with one_thread():
        report = GRPO({"lr": 1e-6}).train_stage(ctx)
    hook.remove()
    assert report.steps[0]["grad_norm"] > 0  # the toy task has a learning signal at step one
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    return changed / sum(b.numel() for b in before), seen


def test_mixed_precision_keeps_small_updates_that_bf16_weights_lose(tmp_path: Path) -> None:
    fraction, seen = _one_grpo_step(tmp_path / "mixed", mixed_precision=True)
    # every forward, rollouts (no grad) and training (grad), ran under bf16 autocast over the
    # fp32 weights: the method's own autocast, the accelerator has none
    assert seen == {(torch.bfloat16, False), (torch.bfloat16, True)}
    assert fraction > 0.9, fraction  # fp32 master weights: a 1e-6 step moves nearly every one
    # The contrast: weights stored in bf16 round the same update away almost everywhere.
    fraction_bf16, seen_bf16 = _one_grpo_step(tmp_path / "bf16", mixed_precision=False)
    assert seen_bf16 == {(torch.bfloat16, False), (torch.bfloat16, True)}
    assert fraction_bf16 < 0.1, fraction_bf16


def test_forwards_under_the_runs_autocast_see_every_weight_update() -> None:
    """The run's autocast spans evaluation and training, so it must not keep torch's cache of
    bf16 weight copies: with it, every forward after the first used the weights as first cast
    (the base model), rows after a stage scored the base model's linear layers, and a training
    forward after a no-grad one got no gradient for them."""
    dist = Distributed.create("cpu", "bfloat16", True)
    model, _ = load_model("tiny-llama", device="cpu", dtype=dist.precision.weights, seed=0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    weight = model.model.layers[0].mlp.down_proj.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with dist.autocast():
        with torch.no_grad():
            before = model(input_ids=ids).logits  # as row 0's evaluation does
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        assert weight.grad is not None and float(weight.grad.abs().sum()) > 0
        optimizer.step()
        with torch.no_grad():
            after = model(input_ids=ids).logits
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = model(input_ids=ids).logits  # a new autocast casts the updated weights
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh)


def test_prepared_student_autocasts_only_under_the_runs_autocast() -> None:
    """The accelerator has no mixed precision of its own: accelerate would wrap the prepared
    forward in an autocast read from its process-wide state at prepare time (which another
    Accelerator can change); the run's `Distributed.autocast()` is the only one."""
    dist = Distributed.create("cpu", "bfloat16", True)
    assert dist.precision.mixed and dist.accelerator.mixed_precision == "no"
    model, _ = load_model("tiny-llama", device="cpu", dtype=dist.precision.weights, seed=0)
    train_model = dist.prepare_student(model)
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: seen.append(out.dtype))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        train_model(input_ids=ids, hidden_only=True)
        with dist.autocast():
            train_model(input_ids=ids, hidden_only=True)
    assert seen == [torch.float32, torch.bfloat16]


def test_several_processes_refuse_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="no CUDA device is available"):
        Distributed.create("cuda", "float32")
    with pytest.raises(ModelLoadError, match="not a valid torch device"):
        Distributed.create("gpu0", "float32")


# ---------------------------------------------------------------------------------------------
# Gradients that do not depend on the number of processes
# ---------------------------------------------------------------------------------------------


class FakeRank(Distributed):
    """One process standing in for rank `rank` of `world`: `sum_int` answers `total` (as if the
    other ranks had added theirs) and nothing is communicated; the test averages the ranks'
    gradients itself, as DDP would."""

    def __init__(self, base: Distributed, rank: int, world: int, total: int) -> None:
        super().__init__(base.accelerator, base.device, base.precision)
        self.rank, self.world, self.total = rank, world, total

    num_processes = property(lambda self: self.world)  # type: ignore[assignment]
    process_index = property(lambda self: self.rank)  # type: ignore[assignment]

    def sum_int(self, value: int) -> int:
        return self.total

    def no_sync(self, train_model: Any, sync: bool) -> Any:
        return nullcontext()

    def mean_record(self, record: dict[str, Any]) -> dict[str, Any]:
        return record


def _step_grads(tmp_path: Path, supervise: Callable[[Any], bool],
                dist: Distributed | None = None) -> dict[str, Any]:
    """One on-policy step of :class:`toy.RowNLL` on fixed rollouts (4 prompts x 2, micro-batches
    of one prompt): the gradients the optimizer got (after any all-reduce), the loss, the
    forwards through `train_model`, and this rank's and all ranks' supervised tokens."""
    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=4, samples_per_prompt=2,
                      dist=dist)
    settings = OnPolicySettings(lr=1e-3, max_grad_norm=None, micro_batch_size=2)
    objective = RowNLL(ctx, supervise, settings, generator=FixedGenerator(tok))
    loop = TrainingLoop(ctx, settings, objective)
    grads: list[Any] = []
    loop.optimizer.optimizer.register_step_pre_hook(lambda *_: grads.extend(
        None if p.grad is None else p.grad.detach().clone() for p in model.parameters()))
    forwards = []
    ctx.train_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    before = [p.detach().clone() for p in model.parameters()]
    with one_thread():
        batch, _ = loop.new_batch(0)
        record = loop.update(batch)
    return {"grads": grads, "loss": record["loss"], "forwards": len(forwards),
            "tokens": objective.supervised_tokens(batch), "total": batch.total_tokens,
            "unchanged": all(torch.equal(p, b) for p, b in zip(model.parameters(), before))}


def _first_prompt_of_step(tmp_path: Path) -> str:
    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=4, samples_per_prompt=2)
    return step_examples(ctx.train_examples, 4, 0, ctx.seed)[0].id


SUPERVISE = {
    "all": lambda first: (lambda e: True),
    "rank0_only": lambda first: (lambda e: e.id == first),  # one prompt, on rank 0
    "none": lambda first: (lambda e: False),
}


def _assert_the_optimizer_saw_every_weight(*steps: dict[str, Any]) -> None:
    """Each step's optimizer saw every weight tensor (the hooks that collect the gradients
    fired), so comparisons over them are not vacuous."""
    n_weights = len(list(tiny(seed=0)[0].parameters()))
    assert [len(s["grads"]) for s in steps] == [n_weights] * len(steps)


def _assert_same_step(ranks: list[dict[str, Any]], one: dict[str, Any]) -> None:
    """The ranks' gradients averaged (what DDP applies) are the one-process gradients, and the
    ranks' losses averaged (the step record) are the one-process loss."""
    assert sum(r["tokens"] for r in ranks) == one["total"] == one["tokens"]
    _assert_the_optimizer_saw_every_weight(one, *ranks)
    for i, g in enumerate(one["grads"]):
        parts = [r["grads"][i] for r in ranks]
        assert all(p is not None for p in parts)  # every rank's backward reached every weight
        mean = sum(parts) / len(parts)
        torch.testing.assert_close(mean, g, rtol=1e-4, atol=1e-7)
    assert sum(r["loss"] for r in ranks) / len(ranks) == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.parametrize("case", ["all", "rank0_only"])
def test_two_ranks_take_the_one_process_step(tmp_path: Path, case: str) -> None:
    """Uneven token counts over the ranks, or a rank with no supervised row at all, do not
    reweight the step: each rank divides by the tokens of all ranks over the world size."""
    first = _first_prompt_of_step(tmp_path)
    supervise = SUPERVISE[case](first)
    one = _step_grads(tmp_path / "one", supervise)
    assert one["forwards"] == (4 if case == "all" else 1)  # one process: no zero forwards
    base = Distributed.for_model(tiny(seed=0)[0], "cpu")
    ranks = [_step_grads(tmp_path / f"rank{r}", supervise,
                         FakeRank(base, rank=r, world=2, total=one["total"])) for r in (0, 1)]
    if case == "all":
        assert ranks[0]["tokens"] != ranks[1]["tokens"]  # the test means something
    else:
        assert ranks[1]["tokens"] == 0
    # every rank runs one forward through train_model per micro-batch, zero-weighted where its
    # rows have no loss, so that DDP's all-reduce finds every rank
    assert [r["forwards"] for r in ranks] == [2, 2]
    _assert_same_step(ranks, one)
    if case == "rank0_only":
        assert all(float(g.abs().max()) == 0.0 for g in ranks[1]["grads"])


def _sft_step_grads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    dist: Distributed | None = None) -> dict[str, Any]:
    """One SFT step on toy items whose references have uneven lengths: the gradients the
    optimizer got, the loss and this rank's response tokens."""
    import clbench.train.loop as loop
    import clbench_methods.sft as sft

    model, tok = tiny(seed=0)
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=4, dist=dist)
    ctx.train_examples = [dataclasses.replace(e, reference=e.reference[:1 + 3 * i % 8])
                          for i, e in enumerate(ctx.train_examples)]
    grads: list[Any] = []
    original = loop.optimizer_step

    def step(model: Any, *args: Any) -> Any:
        grads.extend(p.grad.detach().clone() for p in model.parameters())
        return original(model, *args)

    monkeypatch.setattr(loop, "optimizer_step", step)
    with one_thread():
        report = sft.SFT({"lr": 1e-3, "max_grad_norm": None}).train_stage(ctx)
    monkeypatch.undo()
    return {"grads": grads, "loss": report.steps[0]["loss"],
            "tokens": report.counters["trained_tokens"]}


def test_two_sft_ranks_take_the_one_process_step(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    one = _sft_step_grads(tmp_path / "one", monkeypatch)
    base = Distributed.for_model(tiny(seed=0)[0], "cpu")
    ranks = [_sft_step_grads(tmp_path / f"rank{r}", monkeypatch,
                             FakeRank(base, rank=r, world=2, total=one["tokens"])) for r in (0, 1)]
    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # the test means something
    assert ranks[0]["tokens"] + ranks[1]["tokens"] == one["tokens"]
    _assert_the_optimizer_saw_every_weight(one, *ranks)
    for i, g in enumerate(one["grads"]):
        torch.testing.assert_close((ranks[0]["grads"][i] + ranks[1]["grads"][i]) / 2, g,
                                   rtol=1e-4, atol=1e-7)
    assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=1e-5)


def test_a_step_without_supervised_tokens_on_any_rank_is_skipped(tmp_path: Path) -> None:
    supervise = SUPERVISE["none"]("")
    base = Distributed.for_model(tiny(seed=0)[0], "cpu")
    for world in (1, 2):
        dist = FakeRank(base, rank=world - 1, world=world, total=0) if world > 1 else None
        got = _step_grads(tmp_path / str(world), supervise, dist)
        assert got["total"] == 0 and got["forwards"] == 0 and got["loss"] == 0.0
        _assert_the_optimizer_saw_every_weight(got)
        assert all(g is None for g in got["grads"]) and got["unchanged"]


# ---------------------------------------------------------------------------------------------
# Two processes through the CLI
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: list[str], processes: int = 2, script: str | None = None,
            timeout: int = 600, config: Path | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch` N CPU processes (torchrun-style, gloo) running `clbench` (or
    `script`): data parallel, or as the accelerate `config` file says. A script finds the test
    helpers (`toy`, `fakes`) on its path."""
    accelerate = Path(sys.executable).with_name("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH"))
                                          if p))
    target = [script] if script else ["-m", "clbench.cli"]
    how = ["--config_file", str(config)] if config is not None else [
        "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = [str(accelerate), "launch", *how, "--num_processes", str(processes),
           "--main_process_port", str(_free_port()), *target, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


SMALL = ["--set", "protocol.bootstrap_samples=20"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "sdpo", "sft"])
def test_two_process_smoke_run_matches_one_process_row_0(tmp_path: Path, method: str) -> None:
    from clbench.cli import cli

    single = tmp_path / "single"
    # --no-base-cache: both rows 0 are evaluated here (the cache key holds `num_processes`,
    # but a row cached by an earlier session would make the comparison vacuous)
    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method, "--device",
                                   "cpu", "--out", str(single), "--no-base-cache", *SMALL],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = tmp_path / "two"
    # a step checkpoint after every step: its collectives (one decision, counters summed over
    # the ranks) run on both processes, and only the main one writes
    proc = _launch(["run", "--suite", "smoke", "--method", method, "--device", "cpu", "--out",
                    str(out), "--no-base-cache", "--checkpoint-minutes", "0", *SMALL])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("method config") == 1  # only the main process prints
    assert "row 0: eval math (items 1-4 of 8) 4/4, " in proc.stdout  # its share, said so
    result = read_results(out / "results.json")
    assert result.status == "complete" and len(result.matrix) == 3
    assert all(cell is not None and cell.n == 8 for row in result.matrix for cell in row)
    assert result.model.resolved["num_processes"] == 2
    # `auto` resolves by the CPU: bf16 autocast where it computes bf16 natively, else fp32
    precision = "bf16-mixed" if cpu_supports_bf16() else "fp32"
    assert result.model.resolved["precision"] == precision
    assert "stage 2: checkpoint after step 1 of 2" in (out / "run.log").read_text()
    one = read_results(single / "results.json")
    assert one.model.resolved["num_processes"] == 1
    assert one.model.resolved["precision"] == precision
    for run in (result, one):  # both rows 0 were evaluated, not taken from the cache
        assert not run.artifacts.get("base_row", {}).get("reused", False)
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


@pytest.mark.e2e
@pytest.mark.slow
def test_two_processes_refuse_prompts_per_step_that_does_not_divide(tmp_path: Path) -> None:
    proc = _launch(["run", "--suite", "smoke", "--method", "grpo", "--device", "cpu", "--out",
                    str(tmp_path / "r"), "--set", "stages[1].budget.prompts_per_step=3"])
    assert proc.returncode != 0
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "stage 'science': prompts_per_step 3 is not divisible by the 2 processes" in text
    assert not (tmp_path / "r" / "results.json").exists()


@pytest.mark.slow
def test_two_processes_take_the_one_process_step_without_waiting_on_each_other(
        tmp_path: Path) -> None:
    """Real DDP over gloo: uneven token counts, a rank with no supervised row (it must still
    join the all-reduce, or the other waits forever), and a step with none on any rank."""
    first = _first_prompt_of_step(tmp_path)
    out = tmp_path / "out"
    proc = _launch(["ddp-steps", first, str(out)], script=__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for case in SUPERVISE:
        one = _step_grads(tmp_path / case, SUPERVISE[case](first))
        ranks = [torch.load(out / f"{case}-rank{r}.pt") for r in (0, 1)]
        assert [r["total"] for r in ranks] == [one["total"]] * 2
        if case == "none":
            assert [r["forwards"] for r in ranks] == [0, 0]
            _assert_the_optimizer_saw_every_weight(*ranks)
            assert all(g is None for r in ranks for g in r["grads"])
            assert all(r["unchanged"] for r in ranks)
            continue
        assert [r["forwards"] for r in ranks] == [2, 2]
        if case == "rank0_only":
            assert [r["tokens"] for r in ranks] == [one["tokens"], 0]
        else:
            assert ranks[0]["tokens"] != ranks[1]["tokens"]
        _assert_the_optimizer_saw_every_weight(one, *ranks)
        for r in ranks:  # after the all-reduce every rank holds the one-process gradients
            for g, expected in zip(r["grads"], one["grads"]):
                torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)
        assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=1e-5)


def _ddp_steps_worker(first: str, out: Path) -> None:
    """Each rank's :func:`_step_grads` for every case, through the launched run's DDP."""
    dist = Distributed.create("cpu", "float32")
    out.mkdir(parents=True, exist_ok=True)
    for case, make in SUPERVISE.items():
        got = _step_grads(out / case, make(first), dist)
        torch.save(got, out / f"{case}-rank{dist.process_index}.pt")
    dist.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_two_processes_with_addons_take_the_one_process_steps(tmp_path: Path) -> None:
    """SFT with replay, EWC and LwF under DDP: replay chooses the whole step's items before
    they are split, EWC's penalty is the same on every rank, LwF's forward is a second one
    through the prepared student before the one backward and divides by the step's tokens over
    every rank, so two processes take the one-process steps (the same losses and terms)."""
    from clbench.cli import cli

    args = ["run", "--suite", "smoke", "--method", "sft", "--device", "cpu", "--no-base-cache",
            "--addon", "replay", "--addon", "ewc", "--addon", "lwf", "--set", "method.lr=1e-3",
            "--set", "model.dtype=float32", "--set", "addon.replay.fraction=0.5", *SMALL]
    single, two = tmp_path / "single", tmp_path / "two"
    res = CliRunner().invoke(cli, [*args, "--out", str(single)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    proc = _launch([*args, "--out", str(two)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in (1, 2):
        alone, shared = (json.loads((run / "stages" / f"stage{stage}.json").read_text())["steps"]
                         for run in (single, two))
        for key in ("loss", "grad_norm", "ewc_penalty", "lwf_kl", "replayed_fraction"):
            assert [s.get(key, 0.0) for s in shared] == pytest.approx(
                [s.get(key, 0.0) for s in alone], rel=1e-4, abs=1e-9), key
    steps = json.loads((two / "stages" / "stage2.json").read_text())["steps"]
    assert steps[-1]["ewc_penalty"] > 0 and steps[-1]["lwf_kl"] > 0  # the terms acted
    assert [s["replayed_fraction"] for s in steps] == [0.5, 0.5]


# accelerate launch ... tests/train/test_distributed.py ddp-steps FIRST OUT
if __name__ == "__main__":
    if sys.argv[1:2] == ["ddp-steps"]:
        _ddp_steps_worker(sys.argv[2], Path(sys.argv[3]))
