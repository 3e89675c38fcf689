"""lm-eval probes on the in-memory model (offline task shipped in the repo) and task export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from clbench import registry
from clbench.lmeval import (
    OFFLINE_TASK,
    SHIPPED_TASK_DIR,
    LmEvalProbeError,
    export_lm_eval,
    grade_exported_doc,
    resolve_task_folder,
    run_probe,
)
from clbench.specs import LmEvalProbe, SuiteSpec


@pytest.fixture(scope="module")
def tiny() -> tuple:
    from clbench.models import load_model

    return load_model("tiny-llama", device="cpu", dtype="float32", seed=3)


def _choice_logprob(model, tok, context: str, continuation: str) -> float:
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    cont = tok(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_offline_probe_scores_the_in_memory_model(tiny) -> None:
    model, tok = tiny
    model.train()
    cell = run_probe("general", model, tok, LmEvalProbe(task=OFFLINE_TASK, limit=6),
                     batch_size=4, bootstrap_samples=100)
    assert model.training  # the wrapper's eval() is undone
    assert cell.source == "lm_eval" and cell.n == 6 and len(cell.records) == 6
    assert cell.score == pytest.approx(sum(r.correct for r in cell.records) / 6)
    # the records agree with log-likelihoods computed by hand on the same model
    docs = [json.loads(x) for x in
            (SHIPPED_TASK_DIR / f"{OFFLINE_TASK}.jsonl").read_text().splitlines()[:6]]
    model.eval()
    for doc, rec in zip(docs, cell.records):
        context = f"Question: {doc['question']}\nAnswer:"
        scores = [_choice_logprob(model, tok, context, " " + c) for c in doc["choices"]]
        best = max(range(len(scores)), key=scores.__getitem__)
        assert rec.completion == " " + doc["choices"][best]
        assert rec.correct == (best == doc["answer"])


def test_shipped_task_data_is_well_formed() -> None:
    docs = [json.loads(x) for x in
            (SHIPPED_TASK_DIR / f"{OFFLINE_TASK}.jsonl").read_text().splitlines()]
    assert 50 <= len(docs) <= 100
    assert len({d["question"] for d in docs}) == len(docs)
    for d in docs:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        assert 0 <= d["answer"] < 4
    # arithmetic items: the keyed choice is the true value
    for d in docs:
        if d["id"].startswith("ar-"):
            a, op, b = d["question"].removeprefix("What is ").rstrip("?").split()
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert d["choices"][d["answer"]] == str(value), d


def test_relative_data_files_are_resolved_and_function_tags_kept(tmp_path: Path) -> None:
    src = tmp_path / "tasks"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "d.jsonl").write_text('{"q": 1}\n')
    (src / "sub" / "t.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: d.jsonl\n"
        "process_results: !function utils.process\n")
    names = resolve_task_folder(src, tmp_path / "copy")
    assert names == ["mine"]
    text = (tmp_path / "copy" / "sub" / "t.yaml").read_text()
    assert str((src / "sub" / "d.jsonl").resolve()) in text
    assert "!function 'utils.process'" in text or "!function utils.process" in text
    assert (src / "sub" / "t.yaml").read_text().count("test: d.jsonl") == 1  # source untouched


@pytest.mark.slow  # an unknown name makes lm-eval index all of its built-in tasks
def test_unknown_task_is_a_clear_error(tiny) -> None:
    model, tok = tiny
    with pytest.raises(LmEvalProbeError, match="lm-eval task 'no_such_task_xyz' is unknown"):
        run_probe("g", model, tok, LmEvalProbe(task="no_such_task_xyz"))


def test_unknown_metric_and_missing_file_are_clear_errors(tiny) -> None:
    model, tok = tiny
    with pytest.raises(LmEvalProbeError, match="no metric 'f1'.*acc"):
        run_probe("g", model, tok, LmEvalProbe(task=OFFLINE_TASK, metric="f1", limit=2))
    with pytest.raises(LmEvalProbeError, match="does not exist"):
        run_probe("g", model, tok, LmEvalProbe(task="missing/task.yaml"))


def test_export_writes_tasks_that_lm_eval_runs_with_our_grader(tmp_path: Path, tiny) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from test_protocol import PLUGINS, SUITE

    suite = SuiteSpec.model_validate(yaml.safe_load(SUITE))
    with registry.extra_plugins(**PLUGINS):
        paths = export_lm_eval(suite, tmp_path / "export")
        assert [p.name for p in paths] == ["clbench_echo_low.yaml", "clbench_echo_high.yaml",
                                           "clbench_echo_all.yaml"]
        docs = [json.loads(x) for x in
                (tmp_path / "export" / "clbench_echo_high.jsonl").read_text().splitlines()]
        assert len(docs) == 6 and docs[0]["prompt"].endswith("User: #5200\n\nAssistant:")
        assert grade_exported_doc(docs[0], docs[0]["reference"]) == {"acc": 1.0, "reward": 1.0}
        assert grade_exported_doc(docs[0], "3") == {"acc": 0.0, "reward": 0.0}

        model, tok = tiny
        out = simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu"),
            tasks=["clbench_echo_high"], limit=3, log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(tmp_path / "export"),
                                     include_defaults=False))
        samples = out["samples"]["clbench_echo_high"]
        ours = [grade_exported_doc(s["doc"], s["filtered_resps"][0])["acc"] for s in samples]
    assert len(samples) == 3
    assert out["results"]["clbench_echo_high"]["acc,none"] == pytest.approx(sum(ours) / 3)


def test_export_command(tmp_path: Path) -> None:
    from test_protocol import SUITE, run_cli

    suite = tmp_path / "echo.yaml"
    suite.write_text(SUITE)
    res = run_cli(["export-lm-eval", str(tmp_path / "out"), "--suite", str(suite),
                   "--set", "protocol.eval_size=4"])
    assert res.exit_code == 0, res.output
    assert "3 lm-eval tasks (tag clbench_echo)" in " ".join(res.output.split())
    assert len((tmp_path / "out" / "clbench_echo_low.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / "out" / "utils.py").is_file()
