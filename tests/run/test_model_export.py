"""`clbench export-model`: a run's student as a Hugging Face folder that loads on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import SUITE, run_cli, write_suite

pytestmark = pytest.mark.e2e  # a suite run end to end


def test_the_exported_model_is_the_runs_last_student(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 2"))
    run = tmp_path / "run"
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--out", str(run)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "model"
    res = run_cli(["export-model", str(run), str(out)])
    assert res.exit_code == 0, res.output
    assert "after stage 2" in res.output

    exported = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)  # the tokenizer travels with it
    saved = load_file(run / "checkpoints" / "stage2" / "student.safetensors")
    state = exported.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    # trained: not the model the run started from (tiny models are seeded from the run seed)
    from clbench.models import load_model

    start, _ = load_model("tiny-llama", device="cpu", dtype="float32", seed=0)
    assert any(not torch.equal(start.state_dict()[k], v) for k, v in saved.items())

    # stopped while evaluating stage 2 (its row not in the results): the export says so
    from clbench.results import read_results, write_results

    partial = read_results(run / "results.json")
    partial.status, partial.matrix, partial.row_labels = "partial", partial.matrix[:2], \
        partial.row_labels[:2]
    write_results(run / "results.json", partial)
    res = run_cli(["export-model", str(run), str(tmp_path / "model-2")])
    assert res.exit_code == 0, res.output
    assert "after stage 2 (trained; the run stopped before its row of R was complete)" in \
        " ".join(res.output.split())


def test_export_refusals(tmp_path: Path) -> None:
    from clbench.run.model_export import export_model
    from clbench.run.rundir import RunDirError

    with pytest.raises(RunDirError, match="not a run folder"):
        export_model(tmp_path, tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"model": {"name": "tiny-llama"}, "seed": 0}')
    with pytest.raises(RunDirError, match="no checkpoint yet .the run has trained no stage"):
        export_model(run, tmp_path / "model")
    (run / "run.json").write_text("{")
    with pytest.raises(RunDirError, match="run.json is damaged"):
        export_model(run, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_a_model_given_by_a_relative_path_exports_from_another_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clbench.models import load_model

    model, tok = load_model("tiny-llama", device="cpu", dtype="float32", seed=3)
    model.save_pretrained(tmp_path / "models" / "start")
    tok.save_pretrained(tmp_path / "models" / "start")
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    monkeypatch.chdir(tmp_path)
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--model", "models/start", "--out", "run"])
    assert res.exit_code == 0, res.output
    # the run records the folder it trained from, not a path that only this folder resolves
    import json

    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["model"]["name"]
    assert recorded == str((tmp_path / "models" / "start").resolve())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = run_cli(["export-model", "../run", "model"])
    assert res.exit_code == 0, res.output
    assert (elsewhere / "model" / "config.json").is_file()
    # and resuming from there finds the same run
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--model", "../models/start", "--out", "../run", "--resume"])
    assert res.exit_code == 0, res.output

    # a run recorded before model folders were recorded absolute (as given, relative to where
    # it ran) still resumes from there
    identity = json.loads((tmp_path / "run" / "run.json").read_text())
    identity["model"]["name"] = "models/start"
    (tmp_path / "run" / "run.json").write_text(json.dumps(identity))
    monkeypatch.chdir(tmp_path)
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--model", "models/start", "--out", "run", "--resume"])
    assert res.exit_code == 0, res.output


def test_a_run_folder_cannot_let_the_model_run_its_code(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`trust_remote_code: true` written into run.json (a run folder is a file from whoever
    made it) is ignored: only the command's flag allows a repository's code."""
    import json

    import clbench.models as models

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    run = tmp_path / "run"
    assert run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                    "--out", str(run)]).exit_code == 0
    identity = json.loads((run / "run.json").read_text())
    identity["model"]["trust_remote_code"] = True
    (run / "run.json").write_text(json.dumps(identity))
    asked, real = [], models.load_model

    def recording(spec, *args, **kwargs):
        asked.append(spec.trust_remote_code)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(models, "load_model", recording)
    assert run_cli(["export-model", str(run), str(tmp_path / "a")]).exit_code == 0
    assert run_cli(["export-model", str(run), str(tmp_path / "b"),
                    "--trust-remote-code"]).exit_code == 0
    assert asked == [False, True]
