"""lm-eval probes on the in-memory model (offline tasks: shipped in the repo and the fixtures in
tests/fixtures/lmeval), the early check of probe names, and task export."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from lm_eval.api.model import LM
from where import FIXTURES

from clbench.eval.lmeval import check_probe, run_probe
from clbench.eval.lmeval_export import export_lm_eval, grade_exported_doc
from clbench.eval.lmeval_tasks import (
    OFFLINE_TASK,
    SHIPPED_TASK_DIR,
    LmEvalProbeError,
    resolve_task_folder,
)
from clbench.plugins import registry
from clbench.spec.schema import LmEvalProbe, SuiteSpec

FIXTURES = FIXTURES / "lmeval"


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


def test_probe_draws_no_progress_bars_of_its_own(tiny, capfd, tmp_path, monkeypatch) -> None:
    # lm-eval's tqdm bars (building and running requests) and datasets' (building the task's
    # split, the first time: an empty datasets cache here) would interleave with a run's own
    # progress lines on stderr
    import datasets
    import tqdm

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    model, tok = tiny
    run_probe("general", model, tok, LmEvalProbe(task=OFFLINE_TASK, limit=6), batch_size=4)
    err = capfd.readouterr().err
    assert "Running loglikelihood" not in err and "it/s" not in err and "%|" not in err
    assert "Generating" not in err and "examples/s" not in err
    import lm_eval.models.huggingface as hf
    assert hf.tqdm is tqdm.tqdm  # put back afterwards
    assert not datasets.utils.are_progress_bars_disabled()


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


def test_an_invalid_task_yaml_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
    with pytest.raises(LmEvalProbeError, match=r"broken.yaml: not valid YAML"):
        check_probe(LmEvalProbe(task=str(tmp_path / "broken.yaml")))


def _greedy(model, tok, prompt: str, max_tokens: int) -> str:
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:]).split("\n")[0]


def test_a_metric_with_several_filters_is_named_with_its_filter(tiny) -> None:
    model, tok = tiny
    probe = LmEvalProbe(task="fixture_gen_two_filters", metric="exact_match",
                        include_path=str(FIXTURES))
    with pytest.raises(LmEvalProbeError, match=re.escape(
            "reports 'exact_match' under several filters: exact_match,loose, exact_match,strict; "
            "name one as `metric: exact_match,loose`")):
        run_probe("g", model, tok, probe)
    # each filter's value per document, by hand: the greedy answer (loose), its first digit
    # (strict, lm-eval's regex filter; "[invalid]" without one)
    docs = [json.loads(x) for x in (FIXTURES / "gen.jsonl").read_text().splitlines()]
    model.eval()
    loose = [_greedy(model, tok, d["q"], 4) for d in docs]
    strict = [m.group(1) if (m := re.search(r"(\d)", a)) else "[invalid]" for a in loose]
    right = {}
    for name, values in (("strict", strict), ("loose", loose)):
        cell = run_probe("g", model, tok, LmEvalProbe(
            task="fixture_gen_two_filters", metric=f"exact_match,{name}",
            include_path=str(FIXTURES)), batch_size=4, bootstrap_samples=50)
        assert cell.n == len(cell.records) == len(docs)  # one record per document, not per filter
        assert [r.id for r in cell.records] == [str(i) for i in range(len(docs))]
        assert [r.completion for r in cell.records] == values
        right[name] = [v == d["a"] for v, d in zip(values, docs)]
        assert [r.correct for r in cell.records] == right[name]
        assert cell.score == pytest.approx(sum(right[name]) / len(docs))
    assert right["strict"] != right["loose"]  # the data tells the filters apart
    # one filter that is not `none`: a bare metric means it
    cell = run_probe("g", model, tok, LmEvalProbe(
        task="fixture_gen_one_filter", metric="exact_match", include_path=str(FIXTURES)),
        batch_size=4, bootstrap_samples=50)
    assert [r.completion for r in cell.records] == strict
    assert cell.score == pytest.approx(sum(right["strict"]) / len(docs))


def test_a_group_is_scored_by_its_aggregate_over_the_records_of_its_tasks(tiny) -> None:
    model, tok = tiny
    cell = run_probe("g", model, tok, LmEvalProbe(task="fixture_mc_group",
                                                  include_path=str(FIXTURES)),
                     batch_size=4, bootstrap_samples=50)
    model.eval()
    means, total = [], 0
    for name in ("fixture_mc_a", "fixture_mc_b"):
        docs = [json.loads(x) for x in
                (FIXTURES / f"{name.removeprefix('fixture_')}.jsonl").read_text().splitlines()]
        records = [r for r in cell.records if r.id.startswith(f"{name}/")]
        assert [r.id for r in records] == [f"{name}/{i}" for i in range(len(docs))]
        for doc, rec in zip(docs, records):  # the records agree with log-likelihoods by hand
            context = f"Question: {doc['question']}\nAnswer:"
            scores = [_choice_logprob(model, tok, context, " " + c) for c in doc["choices"]]
            best = max(range(len(scores)), key=scores.__getitem__)
            assert rec.completion == " " + doc["choices"][best]
            assert rec.correct == (best == doc["answer"])
        means.append(sum(r.correct for r in records) / len(docs))
        total += len(docs)
    assert cell.n == len(cell.records) == total == 10
    # the group's aggregate (weight_by_size: false): the mean of the tasks' means, which here
    # is not the mean over all documents
    assert cell.score == pytest.approx(sum(means) / 2)
    assert cell.score != pytest.approx(sum(r.correct for r in cell.records) / total)
    with pytest.raises(LmEvalProbeError, match="group 'fixture_mc_group_no_aggregate' reports "
                                               "no aggregate for acc,none"):
        run_probe("g", model, tok, LmEvalProbe(task="fixture_mc_group_no_aggregate",
                                               include_path=str(FIXTURES), limit=1))


def test_check_probe_refuses_an_unknown_name_without_indexing_lm_evals_tasks(monkeypatch
                                                                                ) -> None:
    import lm_eval.tasks

    built: list[dict] = []
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        lambda **kw: built.append(kw) or real(**kw))
    start = time.monotonic()
    with pytest.raises(LmEvalProbeError, match="lm-eval task 'fixture_mc_gruop' is unknown"):
        check_probe(LmEvalProbe(task="fixture_mc_gruop", include_path=str(FIXTURES)))
    assert built == [] and time.monotonic() - start < 20  # no ~15 s index of built-in tasks
    with pytest.raises(LmEvalProbeError, match="'fixture_gen_tasks' is a tag"):
        check_probe(LmEvalProbe(task="fixture_gen_tasks", include_path=str(FIXTURES)))
    check_probe(LmEvalProbe(task="fixture_mc_group", include_path=str(FIXTURES)))
    check_probe(LmEvalProbe(task=str(FIXTURES / "mc_group.yaml")))  # a group's YAML file
    check_probe(LmEvalProbe(task=OFFLINE_TASK))
    assert [kw["include_defaults"] for kw in built] == [False] * 4


def test_check_probe_refuses_a_metric_the_task_will_not_report() -> None:
    """The configs say which `metric,filter` keys lm-eval will report: a bad or ambiguous
    metric fails when the run starts, not after the probe has been evaluated."""
    def check(task: str, metric: str) -> None:
        check_probe(LmEvalProbe(task=task, metric=metric, include_path=str(FIXTURES)))

    with pytest.raises(LmEvalProbeError, match=re.escape(
            "reports 'exact_match' under several filters: exact_match,loose, "
            "exact_match,strict; name one as `metric: exact_match,loose`")):
        check("fixture_gen_two_filters", "exact_match")
    check("fixture_gen_two_filters", "exact_match,strict")
    check("fixture_gen_one_filter", "exact_match")  # its only filter
    with pytest.raises(LmEvalProbeError, match=re.escape(
            "has no metric 'exact_match,none'; it reports: exact_match,strict")):
        check("fixture_gen_one_filter", "exact_match,none")
    with pytest.raises(LmEvalProbeError, match=re.escape(
            "lm-eval task 'fixture_mc_a' has no metric 'acc_norm'; it reports: acc,none")):
        check("fixture_mc_a", "acc_norm")
    with pytest.raises(LmEvalProbeError, match=re.escape(
            "lm-eval task 'fixture_mc_group' has no metric 'f1'; it reports: acc,none")):
        check("fixture_mc_group", "f1")


def test_a_group_of_ours_over_built_in_tasks_brings_the_built_in_index() -> None:
    from lm_eval.tasks import TaskManager

    from clbench.eval.lmeval import _refers_elsewhere

    index = TaskManager(include_path=str(FIXTURES), include_defaults=False).task_index
    assert not _refers_elsewhere(index["fixture_mc_group"].cfg, index)
    assert not _refers_elsewhere(index["fixture_mc_a"].cfg, index)  # a task: no members
    mixed = {"group": "g", "task": ["fixture_mc_a", {"group": "sub", "task": ["arc_easy"]}]}
    assert _refers_elsewhere(mixed, index)
    assert _refers_elsewhere({"group": "g", "task": "hellaswag"}, index)


@pytest.mark.e2e
def test_a_misspelled_lm_eval_task_stops_a_run_before_the_model_loads(tmp_path: Path,
                                                                       monkeypatch) -> None:
    from fakes import SUITE, run_cli, write_suite

    import clbench.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(clbench.models, "load_model", no_model)
    suite = write_suite(tmp_path, SUITE.replace("protocol:", (
        "  - name: general\n    kind: general\n    lm_eval: {task: clbench_general_mcq}\n"
        "protocol:")))
    out = tmp_path / "run"
    start = time.monotonic()
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--out", str(out),
                   "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert f"{suite}: probes[1].lm_eval: lm-eval task 'clbench_general_mcq' is unknown" in \
        " ".join(res.output.split())  # the file and the field, as for any suite mistake
    assert not (out / "results.json").exists() and not (out / "items").exists()
    assert time.monotonic() - start < 20


@pytest.mark.slow  # indexes lm-eval's built-in tasks (~15 s a check)
def test_check_probe_knows_built_in_groups_and_refuses_tags() -> None:
    check_probe(LmEvalProbe(task="mmlu_redux_generative", metric="exact_match"))  # suites/paper
    with pytest.raises(LmEvalProbeError, match="'mmlu_redux_stem_generative' is a tag"):
        check_probe(LmEvalProbe(task="mmlu_redux_stem_generative"))
    with pytest.raises(LmEvalProbeError, match="'mmlu_redux_generativ' is unknown"):
        check_probe(LmEvalProbe(task="mmlu_redux_generativ"))  # a prefix of a known name


def test_export_writes_tasks_that_lm_eval_runs_with_our_grader(tmp_path: Path, tiny) -> None:
    from fakes import PLUGINS, SUITE
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

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
        assert "from clbench.eval.lmeval_export import grade_exported_doc" in \
            (tmp_path / "export" / "utils.py").read_text()

        # the folder works wherever it is: moved, and run from another working directory
        moved = tmp_path / "elsewhere" / "tasks"
        moved.parent.mkdir()
        (tmp_path / "export").rename(moved)
        assert str(tmp_path / "export") not in (moved / "clbench_echo_high.yaml").read_text()
        model, tok = tiny
        out = simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu"),
            tasks=["clbench_echo_high"], limit=3, log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(moved), include_defaults=False))
        samples = out["samples"]["clbench_echo_high"]
        ours = [grade_exported_doc(s["doc"], s["filtered_resps"][0])["acc"] for s in samples]
        assert len(samples) == 3
        assert out["results"]["clbench_echo_high"]["acc,none"] == pytest.approx(sum(ours) / 3)
        # answers right on even-numbered prompts only: lm-eval's score is our grader's, 2 of 3
        scripted = simple_evaluate(
            model=_EvenAnswersRight(), tasks=["clbench_echo_high"], limit=3, log_samples=True,
            bootstrap_iters=0, task_manager=TaskManager(include_path=str(moved),
                                                        include_defaults=False))
    answers = [s["filtered_resps"][0] for s in scripted["samples"]["clbench_echo_high"]]
    assert sorted(answers) == ["3", "7", "7"]  # prompts #5200, #5201, #5202
    assert scripted["results"]["clbench_echo_high"]["acc,none"] == pytest.approx(2 / 3)


class _EvenAnswersRight(LM):
    """An lm-eval model that answers the echo task's "7" when the prompt's number is even and
    "3" otherwise."""

    def generate_until(self, requests, disable_tqdm=False):
        numbers = [int(re.findall(r"#(\d+)", r.args[0])[-1]) for r in requests]
        return ["7" if n % 2 == 0 else "3" for n in numbers]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError("the exported tasks generate")

    loglikelihood_rolling = loglikelihood


def test_an_exported_prompt_ends_with_the_start_of_the_response_and_targets_the_rest(
        tmp_path: Path) -> None:
    """The reasoning format's opened block goes after `Assistant:`; the target (what a few-shot
    example shows, what the model writes) is the reference after it; the grader scores that."""
    from clbench.eval.lmeval_export import render_transcript
    from clbench.tasks.base import THINK_PREFIX

    suite = SuiteSpec.model_validate({"name": "fmt", "stages": [{
        "name": "math", "task": {"source": "math.arithmetic", "params": {"think": True},
                                 "train_size": 4, "eval_size": 2},
        "budget": {"steps": 1}}]})
    export_lm_eval(suite, tmp_path)
    doc = json.loads((tmp_path / "clbench_fmt_math.jsonl").read_text().splitlines()[0])
    assert doc["prompt"].endswith("\n\nAssistant: " + THINK_PREFIX)
    assert doc["prompt"].count("Assistant:") == 2  # the worked example's turn, then this one
    assert doc["target"] == doc["reference"][len(THINK_PREFIX):]
    assert grade_exported_doc(doc, doc["target"]) == {"acc": 1.0, "reward": 1.0}
    plain = [{"role": "user", "content": "Hi"}]
    assert render_transcript(plain) == "User: Hi\n\nAssistant:"


@pytest.mark.e2e
def test_export_command(tmp_path: Path) -> None:
    from fakes import SUITE, run_cli

    suite = tmp_path / "echo.yaml"
    suite.write_text(SUITE)
    res = run_cli(["export-lm-eval", str(tmp_path / "out"), "--suite", str(suite),
                   "--set", "protocol.eval_size=4"])
    assert res.exit_code == 0, res.output
    assert "3 lm-eval tasks (tag clbench_echo)" in " ".join(res.output.split())
    assert len((tmp_path / "out" / "clbench_echo_low.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / "out" / "utils.py").is_file()


@pytest.mark.parametrize("theirs", ["utils.py", "clbench_echo_low.yaml",
                                    "clbench_echo_low.jsonl"])
def test_export_writes_over_no_file_it_did_not_write(tmp_path: Path, theirs: str) -> None:
    """A folder's own `utils.py` (or a task of the same name) is someone's: the export refuses
    and writes nothing; its own earlier export it replaces."""
    from fakes import SUITE, run_cli

    suite = tmp_path / "echo.yaml"
    suite.write_text(SUITE)
    args = ["export-lm-eval", str(tmp_path / "out"), "--suite", str(suite)]
    assert run_cli(args).exit_code == 0
    assert run_cli(args).exit_code == 0  # again over its own export: fine
    if theirs.endswith(".jsonl"):  # items beside a task YAML that is not an export's
        (tmp_path / "out" / "clbench_echo_low.yaml").write_text("task: mine\n")
    (tmp_path / "out" / theirs).write_text("mine = True\n")
    before = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    res = run_cli(args)
    assert res.exit_code == 2
    said = " ".join(res.output.split())
    assert "holds files that clbench did not export, which the export would write over: " \
        in said and str(tmp_path / "out" / theirs) in said
    assert {p.name: p.read_text() for p in (tmp_path / "out").iterdir()} == before


def test_export_refuses_two_columns_that_would_share_a_task_name(tmp_path: Path) -> None:
    from fakes import PLUGINS, SUITE

    from clbench.errors import UserError

    data = yaml.safe_load(SUITE)
    probe = data["probes"][0]
    data["probes"] = [{**probe, "name": "all-x"}, {**probe, "name": "all_x"}]  # both all_x
    suite = SuiteSpec.model_validate(data)
    with registry.extra_plugins(**PLUGINS), pytest.raises(UserError) as err:
        export_lm_eval(suite, tmp_path / "export")
    assert str(err.value) == ("columns 'all-x' and 'all_x' would both be exported as lm-eval "
                              "task 'clbench_echo_all_x' (lm-eval names have no '-' or '.'); "
                              "rename one")
    assert list((tmp_path / "export").glob("*")) == []  # refused before anything is written


def test_export_again_removes_columns_the_suite_no_longer_has_and_nothing_else(
        tmp_path: Path) -> None:
    """The suite's tag would still run a column an earlier export left behind; another suite's
    export and other files in the folder stay."""
    from fakes import PLUGINS, SUITE

    data = yaml.safe_load(SUITE)
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.yaml").write_text("# mine\n")
    with registry.extra_plugins(**PLUGINS):
        other = SuiteSpec.model_validate({**data, "name": "echo-other"})  # 'echo' + a suffix
        export_lm_eval(other, out)
        export_lm_eval(SuiteSpec.model_validate(data), out)
        data["probes"] = [{**data["probes"][0], "name": "every"}]  # `all` renamed
        removed: list[Path] = []
        export_lm_eval(SuiteSpec.model_validate(data), out, removed)
    assert removed == [out / "clbench_echo_all.yaml", out / "clbench_echo_all.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["notes.yaml", "utils.py"] + [f"clbench_echo_{c}.{ext}" for c in ("low", "high", "every")
                                      for ext in ("yaml", "jsonl")]
        + [f"clbench_echo_other_{c}.{ext}" for c in ("low", "high", "all")
           for ext in ("yaml", "jsonl")])


def test_export_writes_nothing_when_a_column_cannot_be_built(tmp_path: Path) -> None:
    from clbench.errors import UserError

    data = yaml.safe_load(_smoke_yaml())
    data["stages"][1]["task"]["eval_size"] = 10000  # more element symbols than there are
    suite = SuiteSpec.model_validate(data)
    with pytest.raises(UserError, match="10000 requested"):
        export_lm_eval(suite, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def _smoke_yaml() -> str:
    from clbench.spec.suites import resolve_suite

    return resolve_suite("smoke").read_text()


def test_export_refuses_the_name_of_a_shipped_task(tmp_path: Path) -> None:
    """Suite `general` with a column `mc` would be exported as the shipped probe's task
    `clbench_general_mc`, and a probe including the export would see two tasks of that name."""
    from fakes import PLUGINS, SUITE

    from clbench.errors import UserError

    data = yaml.safe_load(SUITE)
    data["name"] = "general"
    data["probes"] = [{**data["probes"][0], "name": "mc"}]
    suite = SuiteSpec.model_validate(data)
    with registry.extra_plugins(**PLUGINS), pytest.raises(UserError) as err:
        export_lm_eval(suite, tmp_path / "export")
    assert "column 'mc' would be exported as lm-eval task 'clbench_general_mc', the name of a " \
           "task shipped with clbench" in str(err.value)
    assert list((tmp_path / "export").glob("*")) == []


def test_promised_keys_of_real_lm_eval_configs() -> None:
    """The configs of lm-eval's own tasks, as its index holds them: a metric given as
    `!function utils.pass_at_1` is indexed as a path but reported under the function's name,
    so the config promises nothing checkable (a correct probe metric must not be refused)."""
    from clbench.eval.lmeval import promised_keys

    gsm8k = {"task": "gsm8k", "metric_list": [{"metric": "exact_match"}],
             "filter_list": [{"name": "strict-match"}, {"name": "flexible-extract"}]}
    assert promised_keys(gsm8k) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    mmlu = {"group": "mmlu", "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}]}
    assert promised_keys(mmlu) == {"acc,none"}
    redux = {"group": "mmlu_redux_generative", "aggregate_metric_list": [
        {"metric": "exact_match", "filter_list": "default"}]}
    assert promised_keys(redux) == {"exact_match,default"}
    mbpp = {"task": "mbpp", "metric_list": [
        {"metric": "/site-packages/lm_eval/tasks/mbpp/utils.pass_at_1"}]}
    assert promised_keys(mbpp) is None
    assert promised_keys({"task": "t", "metric_list": [{"metric": len}]}) is None
