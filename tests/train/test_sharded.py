"""Sharded training (FSDP2) through accelerate: which configs are taken or refused, which
methods may run sharded, and two CPU processes over gloo training the smoke suite as one
process (sft) and as data parallel (sdpo) do."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate
import pytest
import torch
from accelerate.utils import DistributedType
from click.testing import CliRunner
from packaging.version import Version
from safetensors.torch import load_file
from test_distributed import _launch
from where import REPO

from clbench.errors import UserError
from clbench.results import read_results
from clbench.run.setup import check_sharding_support
from clbench.spec.schema import MethodSpec
from clbench.train.distributed import FSDP2_ACCELERATE, sharding_of

ROOT = REPO
FSDP2_CONFIG = ROOT / "examples" / "accelerate" / "fsdp2.yaml"


# the lowest accelerate clbench allows predates FSDP2: there a sharded launch is refused
HAS_FSDP2 = Version(accelerate.__version__) >= Version(FSDP2_ACCELERATE)


def _accelerator(kind: DistributedType, version: int | None = None) -> Any:
    plugin = SimpleNamespace(fsdp_version=version) if version is not None else None
    return SimpleNamespace(state=SimpleNamespace(distributed_type=kind, fsdp_plugin=plugin))


def test_an_fsdp2_config_shards_and_others_train_unsharded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    if HAS_FSDP2:
        assert sharding_of(_accelerator(DistributedType.FSDP, 2)) == "fsdp2"
    else:
        with pytest.raises(UserError, match=rf"needs accelerate >= {FSDP2_ACCELERATE}, this "
                                            f"environment has {accelerate.__version__}"):
            sharding_of(_accelerator(DistributedType.FSDP, 2))
    assert sharding_of(_accelerator(DistributedType.MULTI_GPU)) is None
    assert sharding_of(_accelerator(DistributedType.MULTI_CPU)) is None
    assert sharding_of(_accelerator(DistributedType.NO)) is None


def test_on_cpus_the_fsdp_config_accelerate_ignores_is_honoured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `accelerate launch --config_file fsdp2.yaml` on CPUs: the env says FSDP, accelerate's
    # state says MULTI_CPU (it would train DDP); clbench shards
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    accelerator = _accelerator(DistributedType.MULTI_CPU)
    if not HAS_FSDP2:
        with pytest.raises(UserError, match="needs accelerate >= "):
            sharding_of(accelerator)
        return
    assert sharding_of(accelerator) == "fsdp2"
    assert accelerator.state.distributed_type == DistributedType.FSDP
    assert accelerator.state.fsdp_plugin.fsdp_version == 2


def test_fsdp1_and_deepspeed_are_refused_with_what_to_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fsdp1 = r"FSDP version 1 is not supported.*fsdp_version: 2" if HAS_FSDP2 else \
        "needs accelerate >= "
    with pytest.raises(UserError, match=fsdp1):
        sharding_of(_accelerator(DistributedType.FSDP, 1))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UserError, match=fsdp1):
        sharding_of(_accelerator(DistributedType.MULTI_CPU))
    with pytest.raises(UserError, match="DeepSpeed is not supported.*FSDP2 instead"):
        sharding_of(_accelerator(DistributedType.DEEPSPEED))


def test_a_sharded_launch_refuses_plugins_that_have_not_declared_it() -> None:
    from clbench.api import SFT
    from clbench.plugins import registry
    from clbench.spec.schema import AddOnSpec

    class SFTVariant(SFT):  # a subclass is not trusted with its parent's declaration
        name = "sft-variant"

    def run_of(method: str, *addons: str) -> SimpleNamespace:
        return SimpleNamespace(method=MethodSpec(name=method),
                               addons=[AddOnSpec(name=a) for a in addons])

    sharded, unsharded = SimpleNamespace(sharding="fsdp2"), SimpleNamespace(sharding=None)
    with pytest.raises(UserError, match="the method 'sft-variant' does not support sharded "
                                        r"training \(fsdp2, from the accelerate config\)"):
        check_sharding_support(run_of("sft-variant"), SFTVariant(), [], sharded)  # type: ignore[arg-type]
    check_sharding_support(run_of("sft-variant"), SFTVariant(), [], unsharded)  # type: ignore[arg-type]
    for name in ("sft", "grpo", "sdpo", "sdpo-cot", "stable-sdpo"):
        method = registry.build_method(MethodSpec(name=name))
        check_sharding_support(run_of(name), method, [], sharded)  # type: ignore[arg-type]
    # add-ons alike: replay only chooses items; ewc reads the plain student's weights
    sft = registry.build_method(MethodSpec(name="sft"))
    replay, ewc = registry.build_addons([AddOnSpec(name="replay"), AddOnSpec(name="ewc")])
    check_sharding_support(run_of("sft", "replay"), sft, [replay], sharded)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="the add-on 'ewc' does not support sharded training"):
        check_sharding_support(run_of("sft", "replay", "ewc"), sft, [replay, ewc], sharded)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Two CPU processes, sharded
# ---------------------------------------------------------------------------------------------

# fp32: the comparison is of weights, and bf16 autocast rounds differently per batch layout
RUN = ["--suite", "smoke", "--device", "cpu", "--no-base-cache", "--set", "model.dtype=float32",
       "--set", "protocol.bootstrap_samples=20"]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "stage2" / "student.safetensors"))


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _sharded_run(out: Path, method: str) -> Any:
    proc = _launch(["run", "--method", method, "--out", str(out), *RUN], config=FSDP2_CONFIG)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = read_results(out / "results.json")
    assert result.status == "complete"
    assert result.model.resolved["sharding"] == "fsdp2"
    assert result.model.resolved["num_processes"] == 2
    log = (out / "run.log").read_text()
    # each process holds about half of the 80,512 parameters of the tiny model
    assert "student sharded (fsdp2) over 2 processes: this one holds 40288 of its 80512 " \
        "parameters" in log
    return result


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_sharded_over_two_processes_trains_as_one_process(tmp_path: Path) -> None:
    from clbench.cli import cli

    one = tmp_path / "one"
    res = CliRunner().invoke(cli, ["run", "--method", "sft", "--out", str(one), *RUN],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    sharded = _sharded_run(tmp_path / "fsdp", "sft")
    alone = read_results(one / "results.json")
    assert "sharding" not in alone.model.resolved
    assert sharded.matrix == alone.matrix
    # SFT draws the same items either way: the ranks' gradients, reduce-scattered, are the one
    # process's up to fp32 rounding, so the weights after both stages agree to about 1 ulp,
    # far below what training moved them
    base = load_file(str(one / "checkpoints" / "base-weights.safetensors"))
    weights = _final_weights(one)
    moved = max(float((weights[k] - base[k]).abs().max()) for k in weights.keys() & base.keys())
    assert moved > 1e-5
    assert _largest_difference(_final_weights(tmp_path / "fsdp"), weights) < 1e-6
    stage = json.loads((tmp_path / "fsdp" / "stages" / "stage1.json").read_text())
    assert stage["counters"]["optimizer_steps"] == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_sdpo_sharded_over_two_processes_trains_as_data_parallel(tmp_path: Path) -> None:
    # Two processes sample their rollouts from their own streams, so the comparison is with
    # data parallel on two processes: the same rollouts, teachers and losses
    ddp = tmp_path / "ddp"
    proc = _launch(["run", "--method", "sdpo", "--out", str(ddp), *RUN])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sharded = _sharded_run(tmp_path / "fsdp", "sdpo")
    assert sharded.matrix == read_results(ddp / "results.json").matrix
    assert _largest_difference(_final_weights(tmp_path / "fsdp"), _final_weights(ddp)) < 1e-6
    for i in (1, 2):
        steps = [json.loads((d / "stages" / f"stage{i}.json").read_text())["steps"]
                 for d in (ddp, tmp_path / "fsdp")]
        assert [s["loss"] for s in steps[0]] == pytest.approx([s["loss"] for s in steps[1]],
                                                              rel=1e-5)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_lora_adapter_trains_alike_alone_data_parallel_and_sharded(tmp_path: Path) -> None:
    """SFT of a LoRA adapter: one process, two data-parallel processes and two FSDP2 processes
    end with the same adapter (the frozen base weights untouched everywhere)."""
    from clbench.cli import cli

    lora = [*RUN, "--set", "model.adapter.kind=lora", "--set", "model.adapter.r=4"]
    one = tmp_path / "one"
    res = CliRunner().invoke(cli, ["run", "--method", "sft", "--out", str(one), *lora],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for name, config in (("ddp", None), ("fsdp", FSDP2_CONFIG)):
        out = tmp_path / name
        proc = _launch(["run", "--method", "sft", "--out", str(out), *lora], config=config)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = read_results(out / "results.json")
        assert result.model.resolved["num_processes"] == 2
        assert result.matrix == read_results(one / "results.json").matrix
        weights, alone = _final_weights(out), _final_weights(one)
        assert any(".lora_B." in k and float(alone[k].abs().max()) > 0 for k in alone)
        assert _largest_difference(weights, alone) < 1e-6, name
