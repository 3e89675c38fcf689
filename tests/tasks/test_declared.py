"""Tasks declared in task files: records rendered by the file's templates, graded by the grader
it names, read relative to the suite that names them and hashed into it; no code from a file."""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest
from fakes import run_cli
from where import REPO

from clbench.plugins import registry
from clbench.spec.reading import SpecError
from clbench.spec.schema import MEASURED_EXCLUDES, TaskSpec
from clbench.spec.suites import load_suite, read_task_file_of
from clbench.tasks.templates import TaskFileError

RECORDS = [{"id": f"r{i}", "a": i, "b": 2 * i, "sum": str(3 * i)} for i in range(10)]

TASK = """\
schema_version: 1
name: toy.sums
version: "2"
domain: math
dataset: {path: data/sums.jsonl}
splits: {train: "train[:60%]", eval: "train[60%:]"}
key: "{{ id }}"
system: Answer in a box.
few_shot:
  - {user: "1 + 1?", assistant: "\\\\boxed{2}"}
prompt: "{{ a }} + {{ b }}?"
answer: "{{ sum }}"
grader: boxed_math
metadata: {size: "{{ 'big' if a > 5 else 'small' }}"}
"""


def write_task(folder: Path, text: str = TASK, records: list[dict] = RECORDS,
               name: str = "sums.yaml") -> Path:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def file_task(path: Path, **params: object) -> object:
    spec = TaskSpec(source=str(path), params=params)
    read_task_file_of(spec, Path.cwd())
    return registry.build_task(spec)


def test_items_are_the_records_rendered_by_the_templates(tmp_path: Path) -> None:
    task = file_task(write_task(tmp_path))
    assert (task.name, task.version, task.domain, task.origin) == ("toy.sums", "2", "math",
                                                                   "offline")
    evals = sorted(task.items("eval"), key=lambda ex: ex.id)
    assert [ex.id for ex in evals] == ["toy.sums:r6", "toy.sums:r7", "toy.sums:r8",
                                       "toy.sums:r9"]  # train[60%:] of ten records
    assert len(task.items("train")) == 6
    r7 = evals[1]
    assert r7.messages == [{"role": "system", "content": "Answer in a box."},
                           {"role": "user", "content": "1 + 1?"},
                           {"role": "assistant", "content": "\\boxed{2}"},
                           {"role": "user", "content": "7 + 14?"}]
    assert (r7.answer, r7.reference, r7.metadata) == ("21", "\\boxed{21}", {"size": "big"})
    assert task.grade(r7, "7 plus 14 is \\boxed{21}").correct
    assert task.grade(r7, "\\boxed{22}").feedback == "Your answer 22 is wrong."


def test_a_larger_draw_starts_with_the_smaller_one(tmp_path: Path) -> None:
    """`tasks grade --index I` grades the item `tasks show` lists at I, whatever its --n."""
    task = file_task(write_task(tmp_path))
    assert task.examples("train", 5, 6)[:3] == task.examples("train", 5, 3)
    assert task.examples("train", 5, 3) != task.examples("train", 6, 3)


def test_a_filter_skips_records_and_hash_assignment_splits_one_split(tmp_path: Path) -> None:
    text = TASK.replace('splits: {train: "train[:60%]", eval: "train[60%:]"}',
                        'splits: {train: train, eval: train, assign: hash, '
                        'eval_fraction: 0.5}\nfilter: "a % 2 == 0"')
    task = file_task(write_task(tmp_path, text, RECORDS * 2))  # each record twice: kept once
    train, evals = task.items("train"), task.items("eval")
    ids = sorted(ex.id for ex in train + evals)
    assert ids == sorted(f"toy.sums:r{i}" for i in (0, 2, 4, 6, 8))
    assert not {ex.id for ex in train} & {ex.id for ex in evals}


GRADED = [  # grader, grader_args, answer template, (completion, correct)...
    ("boxed_math", {}, "{{ sum }}", [("\\boxed{21}", True), ("\\boxed{21.0}", True),
                                      ("21", False)]),
    ("choice", {"letters": "ABC"}, "B", [("<answer>B</answer>", True), ("Answer: C", False)]),
    ("exact", {}, "Twenty-one", [("so\ntwenty-one", True), ("twenty-one\nno", False)]),
    ("exact", {"extract": "answer_tag", "case_sensitive": True}, "Pa",
     [("<answer>Pa</answer>", True), ("<answer>pa</answer>", False)]),
    ("regex", {"pattern": "RESULT=(\\d+)"}, "{{ sum }}",  # a reference template: RESULT=21
     [("RESULT=3 then RESULT=21", True), ("RESULT=3", False), ("21", False)]),
    ("tool_calls", {}, '[{"name": "add", "arguments": {"x": [{{ a }}], "y": [{{ b }}]}}]',
     [('{"name": "add", "arguments": {"x": 7, "y": 14}}', True),
      ('{"name": "add", "arguments": {"x": 7, "y": 15}}', False)]),
]


@pytest.mark.parametrize(("grader", "args", "answer", "cases"), GRADED,
                         ids=[f"{g[0]}-{i}" for i, g in enumerate(GRADED)])
def test_each_grader_by_name(tmp_path: Path, grader: str, args: dict, answer: str,
                             cases: list) -> None:
    text = TASK.replace("grader: boxed_math", f"grader: {grader}\ngrader_args: "
                        f"{json.dumps(args)}").replace('answer: "{{ sum }}"',
                                                       f"answer: {json.dumps(answer)}")
    if grader == "regex":
        text = text.replace("grader: regex", 'reference: "RESULT={{ sum }}"\ngrader: regex')
    task = file_task(write_task(tmp_path, text))
    r7 = next(ex for ex in task.items("eval") if ex.id == "toy.sums:r7")
    assert task.grade(r7, r7.reference).correct  # the grader's default reference
    for completion, correct in cases:
        assert task.grade(r7, completion).correct is correct, completion


def test_a_backtracking_pattern_is_graded_wrong_in_bounded_time(tmp_path: Path) -> None:
    text = TASK.replace("grader: boxed_math", 'grader: regex\ngrader_args: {pattern: "(a+)+$"}')
    task = file_task(write_task(tmp_path, text))
    item = task.items("eval")[0]
    start = time.perf_counter()
    assert not task.grade(item, "a" * 40 + "b").correct
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ self._TemplateReference__context }}",
    "{% set x = [].append(1) %}{{ a }}",
])
def test_templates_run_in_a_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    template: str) -> None:
    monkeypatch.chdir(tmp_path)
    text = TASK.replace('prompt: "{{ a }} + {{ b }}?"', f"prompt: {json.dumps(template)}")
    with pytest.raises(TaskFileError, match="prompt"):
        file_task(write_task(tmp_path, text)).items("eval")
    assert not (tmp_path / "MARKER").exists()


def test_a_template_that_never_ends_is_stopped(tmp_path: Path) -> None:
    text = TASK.replace('prompt: "{{ a }} + {{ b }}?"', 'prompt: "{% for i in range(100000) '
                        '%}{% for j in range(100000) %}{% endfor %}{% endfor %}"')
    start = time.perf_counter()
    with pytest.raises(TaskFileError, match="took more than"):
        file_task(write_task(tmp_path, text)).items("eval")
    assert time.perf_counter() - start < 10


SUITE = """\
name: sums-then-sums
stages:
  - name: sums
    task: {source: tasks/sums.yaml, train_size: 4, eval_size: 2}
    budget: {steps: 1}
"""


def test_a_suite_reads_its_task_file_relative_to_itself_and_hashes_what_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_task(tmp_path / "a" / "tasks")
    (tmp_path / "a" / "suite.yaml").write_text(SUITE)
    monkeypatch.chdir(tmp_path)  # not the suite's folder
    suite = load_suite(tmp_path / "a" / "suite.yaml")
    task = suite.stages[0].task
    assert task.definition is not None and task.definition.name == "toy.sums"
    assert task.name == "toy.sums"
    first = suite.content_hash()

    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same files elsewhere: the same suite
    moved = load_suite(tmp_path / "b" / "suite.yaml")
    assert moved.content_hash() == first
    # and the same run's suite, for --resume from the new place
    assert moved.model_dump(mode="json", exclude=MEASURED_EXCLUDES) == \
        suite.model_dump(mode="json", exclude=MEASURED_EXCLUDES)

    data = tmp_path / "b" / "tasks" / "data" / "sums.jsonl"
    data.write_text(data.read_text().replace('"sum": "3"', '"sum": "4"'))
    assert load_suite(tmp_path / "b" / "suite.yaml").content_hash() != first

    task_file = tmp_path / "a" / "tasks" / "sums.yaml"
    task_file.write_text(task_file.read_text().replace("Answer in a box.", "Box it."))
    assert load_suite(tmp_path / "a" / "suite.yaml").content_hash() != first


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("data/sums.jsonl", "data/gone.jsonl"),
     r"task.source: toy.sums: dataset.path: data file .*gone.jsonl does not exist "
     r"\(relative paths resolve against the task file\)"),
    (lambda t: t.replace("dataset: {path: data/sums.jsonl}",
                         "dataset: {path: data/sums.jsonl, sha256: " + "a" * 64 + "}"),
     "dataset.sha256: .*sums.jsonl has SHA-256 [0-9a-f]{64}, not the aaaa"),
    (lambda t: t + "promtp: x\n", "promtp"),
    (lambda t: t.replace("grader: boxed_math", "grader: python"), "grader"),
    (lambda t: t.replace('splits: {train: "train[:60%]", eval: "train[60%:]"}',
                         "splits: {train: train, eval: train}"),
     "train and eval name the same records"),
])
def test_a_bad_task_file_is_one_message_naming_the_field(tmp_path: Path, edit, message
                                                          ) -> None:
    write_task(tmp_path / "tasks", edit(TASK))
    (tmp_path / "suite.yaml").write_text(SUITE)
    with pytest.raises(SpecError, match=message):
        load_suite(tmp_path / "suite.yaml")


def test_a_suite_cannot_write_a_task_definition_by_hand(tmp_path: Path) -> None:
    write_task(tmp_path / "tasks")
    (tmp_path / "suite.yaml").write_text(SUITE.replace(
        "eval_size: 2}", "eval_size: 2, folder: /etc}"))
    with pytest.raises(SpecError, match="stages.0..task: definition, folder and suite_folder "
                       "are filled in when the suite is read; remove them"):
        load_suite(tmp_path / "suite.yaml")


def test_validate_grades_the_reference_of_a_few_items(tmp_path: Path) -> None:
    write_task(tmp_path / "tasks", TASK.replace('grader: boxed_math',
                                                'reference: "{{ a }}"\ngrader: boxed_math'))
    (tmp_path / "suite.yaml").write_text(SUITE)
    result = run_cli(["validate", str(tmp_path / "suite.yaml")])
    assert result.exit_code == 2  # a user error
    assert "the reference of item toy.sums:" in result.output
    assert "grades wrong under grader boxed_math (No final answer in \\boxed{} found.)" \
        in result.output


def test_tasks_show_and_grade_a_task_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.chdir(tmp_path)
    write_task(tmp_path)
    shown = run_cli(["tasks", "show", "sums.yaml", "--n", "2"])
    assert shown.exit_code == 0, shown.output
    task = file_task(tmp_path / "sums.yaml")
    first, second = task.examples("eval", 1234, 2)
    assert shown.output.index(first.id) < shown.output.index(second.id)

    (tmp_path / "answer.txt").write_text(f"so \\boxed{{{second.answer}}}")
    graded = run_cli(["tasks", "grade", "sums.yaml", "--index", "1", "--completion-file",
                      "answer.txt", "--json"])
    assert json.loads(graded.output) == {"id": second.id, "correct": True, "reward": 1.0,
                                         "feedback": None, "format_error": False}
    (tmp_path / "answer.txt").write_text("no idea")
    graded = run_cli(["tasks", "grade", "sums.yaml", "--index", "1", "--completion-file",
                      "answer.txt"])
    assert graded.output.splitlines()[1:] == [
        "correct: false", "reward: 0.000", "feedback: No final answer in \\boxed{} found."]
    past = run_cli(["tasks", "grade", "sums.yaml", "--index", "9", "--completion-file",
                    "answer.txt"])
    assert past.exit_code == 2
    assert "--index 9: the eval split of toy.sums has 4 items" in past.output


def test_the_shipped_example_suite_validates_and_its_task_file_shows_items() -> None:
    result = run_cli(["validate", str(REPO / "examples" / "tasks" / "suite.yaml")])
    assert result.exit_code == 0, result.output
    spec = TaskSpec(source="units.yaml")
    read_task_file_of(spec, REPO / "examples" / "tasks")
    task = registry.build_task(spec)
    item = task.examples("eval", 0, 1)[0]
    value, unit, _, to = item.messages[-1]["content"].split(".")[0].split()[1:5]
    factors = {("km", "m"): 1000, ("kg", "g"): 1000, ("h", "min"): 60, ("min", "s"): 60,
               ("day", "h"): 24, ("m", "cm"): 100, ("g", "mg"): 1000, ("L", "mL"): 1000,
               ("m", "mm"): 1000, ("t", "kg"): 1000}
    expected = int(value) * factors[(unit, to)] if (unit, to) in factors else \
        int(value) // factors[(to, unit)]
    assert item.answer == str(expected)


@pytest.mark.e2e
def test_a_suite_whose_stage_is_a_task_file_trains(tmp_path: Path) -> None:
    """The shipped example (units.yaml over a local JSONL, then arithmetic) run end to end on a
    tiny model: the task file's column carries its name and version."""
    from clbench.results import read_results

    out = tmp_path / "run"
    result = run_cli(["run", "--suite", str(REPO / "examples" / "tasks" / "suite.yaml"),
                      "--method", "sft", "--model", "tiny-llama", "--device", "cpu",
                      "--out", str(out), "--no-base-cache", "--set", "protocol.eval_size=4",
                      "--set", "stages[0].task.eval_size=4", "--set", "stages[1].task.eval_size=4",
                      "--set", "stages[0].budget.steps=2", "--set", "stages[1].budget.steps=1",
                      "--set", "protocol.bootstrap_samples=20"])
    assert result.exit_code == 0, result.output
    done = read_results(out / "results.json")
    assert done.status == "complete"
    units = done.columns[0]
    assert (units.name, units.source, units.source_version) == ("units", "units.metric",
                                                                "1")
    assert len(done.matrix) == 3 and all(len(row) == 2 for row in done.matrix)
    assert [s.name for s in done.stages] == ["units", "arithmetic"]


def test_the_task_file_in_the_docs_is_the_shipped_example() -> None:
    import re

    import yaml

    docs = (REPO / "docs" / "tasks.md").read_text()
    section = docs[docs.index("### As data: a task file"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    shipped = (REPO / "examples" / "tasks" / "units.yaml").read_text()
    assert yaml.safe_load(block) == yaml.safe_load(shipped)


@pytest.mark.parametrize("source", ["math.arithmetic", "science.facts", "tool_use.generated",
                                    "code.generated"])
def test_tasks_grade_grades_every_domain(tmp_path: Path, source: str) -> None:
    spec = TaskSpec(source=source)
    item = registry.build_task(spec).examples("eval", 1234, 3)[2]
    answer = tmp_path / "answer.txt"
    answer.write_text(item.reference)
    graded = run_cli(["tasks", "grade", source, "--index", "2", "--completion-file",
                      str(answer), "--json"])
    assert json.loads(graded.output) == {"id": item.id, "correct": True, "reward": 1.0,
                                         "feedback": None, "format_error": False}
    answer.write_text("I do not know.")
    graded = json.loads(run_cli(["tasks", "grade", source, "--index", "2", "--completion-file",
                                 str(answer), "--json"]).output)
    assert graded["correct"] is False and graded["format_error"] is True and graded["feedback"]


def test_the_task_file_schema_is_printed() -> None:
    result = run_cli(["schema", "--task-file"])
    schema = json.loads(result.output)
    assert {"dataset", "splits", "prompt", "answer", "grader"} <= set(schema["required"])
    assert "code_tests" in json.dumps(schema)


def test_relative_data_files_of_a_suite_resolve_against_the_suite_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from where import FIXTURES

    suite_dir = tmp_path / "bench"
    (suite_dir / "data").mkdir(parents=True)
    shutil.copy(FIXTURES / "hub" / "aime25_test.jsonl", suite_dir / "data" / "aime25.jsonl")
    (suite_dir / "suite.yaml").write_text(
        "name: aime\nstages:\n  - name: sums\n    task: {source: tasks/sums.yaml, "
        "train_size: 4, eval_size: 2}\n    budget: {steps: 1}\nprobes:\n  - name: aime25\n"
        "    kind: ood\n    task: {source: math.aime25, params: {data_files: "
        "data/aime25.jsonl}, eval_size: 2}\n")
    write_task(suite_dir / "tasks")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    suite = load_suite(suite_dir / "suite.yaml")
    probe = suite.probes[0].task
    assert probe.params == {"data_files": "data/aime25.jsonl"}  # as written, and so hashed
    assert sorted(e.answer for e in registry.build_task(probe).examples("eval", 0, 2)) == [
        "16", "400"]
    moved = tmp_path / "moved"
    shutil.copytree(suite_dir, moved)
    assert load_suite(moved / "suite.yaml").content_hash() == suite.content_hash()


def test_a_record_too_long_to_render_is_skipped_and_a_too_large_expression_refused(
        tmp_path: Path) -> None:
    records = RECORDS + [{"id": "huge", "a": "9" * 200_000, "b": 1, "sum": "0"}]
    task = file_task(write_task(tmp_path, TASK.replace('splits: {train: "train[:60%]", eval: '
                                                       '"train[60%:]"}', 'splits: {eval: train}'),
                                records))
    assert len(task.items("eval")) == 10  # the record whose prompt would be 200k long is left
    text = TASK.replace('prompt: "{{ a }} + {{ b }}?"', "prompt: \"{{ 'x' * 10 ** 11 }}\"")
    with pytest.raises(TaskFileError, match="too large"):
        file_task(write_task(tmp_path, text)).items("eval")


def test_a_regex_grader_group_the_pattern_lacks_is_refused(tmp_path: Path) -> None:
    text = TASK.replace("grader: boxed_math",
                        'grader: regex\ngrader_args: {pattern: "A=(\\\\d+)", group: 2}')
    with pytest.raises(SpecError, match=r"grader_args.group: 2 is not a group of the pattern "
                       r"\(it has 1\)"):
        file_task(write_task(tmp_path, text))
