"""LoRA adapters (`model.adapter.kind: lora`): only the adapters train, drift is measured on the
merged weights, the export is a plain model (or the adapter in peft's format) computing what the
run's model computes, a resumed run matches an uninterrupted one, and `scope: stage` merges each
stage's adapter."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from fakes import run_cli
from safetensors.torch import load_file
from safetensors.torch import load_model as load_weights

from clbench.adapters import effective_parameters, merge_into_base, merged_copy
from clbench.models import load_model
from clbench.results import read_results
from clbench.spec.schema import AdapterSpec, ModelSpec

pytestmark = pytest.mark.usefixtures("single_thread")

LORA = ["--set", "model.adapter.kind=lora", "--set", "model.adapter.r=4"]


def _run(out: Path, *extra: str) -> None:
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--out", str(out), "--device",
                   "cpu", *LORA, *extra])
    assert res.exit_code == 0, res.output


def test_a_lora_run_trains_only_its_adapters_and_exports_what_it_computes(
        tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    _run(out)
    result = read_results(out / "results.json")
    assert result.status == "complete"
    assert result.model.spec["adapter"]["kind"] == "lora"
    base = load_file(str(out / "checkpoints" / "base-weights.safetensors"))
    trained = load_file(str(out / "checkpoints" / "stage2" / "student.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    # the base weights stay as they were; the adapter moved (B starts at 0)
    assert torch.equal(trained[f"{q}.base_layer.weight"], base[f"{q}.weight"])
    assert trained[f"{q}.lora_B.default.weight"].abs().sum() > 0
    assert torch.equal(trained["model.norm.weight"], base["model.norm.weight"])  # frozen too
    # drift is the merged weights' drift: not zero, though no base weight changed
    drift = result.stages[0].diagnostics["weight_drift"]["vs_base"]["all"]
    assert drift["nss"] > 0 and drift["matrices"] > 0
    assert result.stages[1].diagnostics["weight_drift"]["vs_previous"]["all"]["nss"] > 0

    assert run_cli(["export-model", str(out), str(tmp_path / "merged")]).exit_code == 0
    res = run_cli(["export-model", str(out), str(tmp_path / "adapter"), "--adapter-only"])
    assert res.exit_code == 0 and "wrote the adapter after stage 2" in res.output
    model, _ = load_model(ModelSpec(name="tiny-llama", adapter=AdapterSpec(kind="lora", r=4)),
                          device="cpu", dtype="float32")
    load_weights(model, str(out / "checkpoints" / "stage2" / "student.safetensors"))
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        expected = model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert torch.allclose(merged(ids).logits, expected, atol=1e-5)
        plain, _ = load_model("tiny-llama", device="cpu", dtype="float32")
        plain.load_state_dict(base, strict=False)
        adapted = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
        assert torch.allclose(adapted(ids).logits, expected, atol=1e-5)


def test_an_export_of_a_run_without_an_adapter_refuses_adapter_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--out", str(out), "--device",
                   "cpu", "--set", "stages[0].budget.steps=1", "--set",
                   "stages[1].budget.steps=1"])
    assert res.exit_code == 0, res.output
    res = run_cli(["export-model", str(out), str(tmp_path / "a"), "--adapter-only"])
    assert res.exit_code == 2 and "the run trained no adapter" in res.output


def test_merging_a_stage_adapter_changes_nothing_the_model_computes() -> None:
    """`scope: stage`: the adapter folded into the base weights, a fresh one at 0."""
    model, _ = load_model(ModelSpec(name="tiny-llama", adapter=AdapterSpec(kind="lora", r=4)),
                          device="cpu", dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
        effective = {k: v.clone() for k, v in effective_parameters(model).items()}
        merge_into_base(model)
        assert torch.allclose(model(ids).logits, before, atol=1e-5)
        assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if "lora_B" in n)
        for name, w in effective_parameters(model).items():
            assert torch.allclose(w, effective[name], atol=1e-6), name
        plain = merged_copy(model)
        assert not any("lora" in n for n, _ in plain.named_parameters())
        assert torch.allclose(plain(ids).logits, before, atol=1e-5)


def test_adapter_settings_are_checked_where_they_are_written(tmp_path: Path) -> None:
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--device", "cpu", "--out",
                   str(tmp_path / "r"), *LORA, "--set", "model.adapter.target_modules=[nope]"])
    assert res.exit_code == 2 and "model.adapter" in res.output
    res = run_cli(["run", "--suite", "smoke", "--method", "sft", "--device", "cpu", "--out",
                   str(tmp_path / "v"), *LORA, "--set", "model.generation=vllm"])
    assert res.exit_code == 2 and "model.adapter with model.generation: vllm" in res.output


@pytest.mark.slow
def test_a_lora_run_killed_mid_stage_resumes_to_the_uninterrupted_runs_results(
        tmp_path: Path) -> None:
    from fakes import SUITE, write_suite
    from test_resume import _items, _signal_mid_stage_2

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 3"))
    common = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "3",
              "--device", "cpu", *LORA, "--set", "model.adapter.scope=stage"]
    straight = tmp_path / "straight"
    assert run_cli(common + ["--out", str(straight), "--no-base-cache"]).exit_code == 0
    killed = tmp_path / "killed"
    code, _ = _signal_mid_stage_2(common + ["--out", str(killed)], tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    res = run_cli(common + ["--out", str(killed), "--resume"])
    assert res.exit_code == 0, res.output
    assert "resuming after stage 1" in res.output
    a, b = read_results(straight / "results.json"), read_results(killed / "results.json")
    assert b.status == "complete" and b.model.spec["adapter"]["scope"] == "stage"
    assert b.score_matrix() == a.score_matrix()
    assert [s.summary for s in b.stages] == [s.summary for s in a.stages]
    assert _items(killed) == _items(straight)


def test_a_lora_run_and_a_full_one_of_a_method_are_two_entries(tmp_path: Path) -> None:
    from fakes import result_of, run_spec

    from clbench.report.comparison import comparison_groups

    full = result_of(run_spec("smoke", "sft", out_dir=tmp_path / "a"))
    lora = result_of(run_spec("smoke", "sft", out_dir=tmp_path / "b",
                              overrides=["model.adapter.kind=lora"]))
    for r in (full, lora):
        r.status = "complete"
    groups = comparison_groups([(tmp_path / "a", full), (tmp_path / "b", lora)])
    (labels,) = groups.values()
    assert len(labels) == 2 and any("lora" in label for label in labels)


def test_a_frozen_copy_of_an_adapted_model_copies_only_the_adapters() -> None:
    """The SDPO teacher, GRPO's reference and LwF's stage-start model of a LoRA run share the
    frozen base weights with the student; an EMA step leaves the shared weights exactly as
    they are and moves only the copy's adapters."""
    from clbench_methods.sdpo.teacher import TeacherWeights

    model, _ = load_model(ModelSpec(name="tiny-llama", adapter=AdapterSpec(kind="lora", r=4)),
                          device="cpu", dtype="float32")
    teacher = TeacherWeights("ema", ema_rate=0.5)
    teacher.start_stage(model, 4)
    student = dict(model.named_parameters())
    copied = dict(teacher.model.named_parameters())
    base = "model.layers.0.self_attn.q_proj.base_layer.weight"
    lora = "model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert copied[base].data_ptr() == student[base].data_ptr()    # shared
    assert copied[lora].data_ptr() != student[lora].data_ptr()    # copied
    assert student[lora].requires_grad and not copied[lora].requires_grad
    before = student[base].detach().clone()
    with torch.no_grad():
        student[lora].add_(1.0)
    teacher.after_optimizer_step()
    assert torch.equal(student[base], before)
    assert torch.allclose(copied[lora], student[lora] - 0.5)
