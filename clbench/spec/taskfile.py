"""Task files: a task declared as data (YAML), the way lm-evaluation-harness declares its tasks.

A task file names a dataset (a local JSON/JSONL/CSV/Parquet file beside it, or a hub dataset),
which of its splits clbench trains and evaluates on, sandboxed Jinja2 templates that turn one
record into a prompt, a gold answer and a reference solution, and one of the built-in graders by
name. It names no code: templates run in Jinja2's sandbox, graders are chosen from a fixed list,
and a task file is read exactly like a suite (safe YAML, bounded size, unknown keys refused).

This module owns the model of the file and reading it: a suite's `task: {source: PATH}` (the
path relative to the suite file) is read here and its content, with the data file's SHA-256,
becomes part of the suite's hash. Rendering items and grading them is
:mod:`clbench.tasks.declared`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from clbench.spec.base import NAME_PATTERN, Spec
from clbench.spec.reading import SpecError, read_yaml_document, validate_model

TASK_FILE_SCHEMA_VERSION = 1
TASK_FILE_SUFFIXES = (".yaml", ".yml")
#: Local data files by suffix, as `datasets` loads them.
DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
#: The graders a task file may name (:mod:`clbench.tasks.declared` implements each).
GraderName = Literal["boxed_math", "choice", "exact", "regex", "tool_calls", "code_tests"]
#: Templates longer than this are refused: a task's prompt is a paragraph, not a book.
MAX_TEMPLATE_CHARS = 20_000


#: Names a task file's variables cannot take: the parameters every task file has, and what
#: templates are given besides the record's fields.
RESERVED_NAMES = ("data_files", "name", "revision", "reveal_answer_in_feedback", "record",
                  "options", "options_text", "letter")


def is_task_file(source: str) -> bool:
    """Whether a task `source` names a task file (by its suffix) rather than a registered task."""
    return source.lower().endswith(TASK_FILE_SUFFIXES)


class DatasetSpec(Spec):
    """Where a task's records come from."""

    path: str = Field(description="A local data file (`.json`, `.jsonl`, `.csv`, `.parquet`; "
                      "relative to the task file) or a hub dataset id such as `openai/gsm8k`.")
    name: str | None = Field(default=None, description="Hub dataset configuration (subset).")
    revision: str | None = Field(default=None, description="Hub dataset revision (branch, tag "
                                 "or commit) for reproducible runs.")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 "
                               "of the local data file. Filled in when the file is read (and "
                               "hashed into the suite); when written, the file must match it.")

    @property
    def local(self) -> bool:
        """Whether `path` is a local data file (by its suffix) rather than a hub id."""
        return Path(self.path).suffix.lower() in DATA_FORMATS


class SplitsSpec(Spec):
    """Which records are training items and which evaluation items, in `datasets`' split syntax
    (`train`, `test`, `train[:80%]`, `train[100:200]`)."""

    train: str | None = Field(default=None, description="Split of training items; unset for an "
                              "evaluation-only benchmark (it can then be a probe only).")
    eval: str = Field(description="Split of evaluation items.")
    assign: Literal["split", "hash"] = Field(default="split", description="`split`: each split "
                                             "as named. `hash`: train and eval name one split "
                                             "and each record goes to one of them by a hash of "
                                             "its key (a dataset with a single split).")
    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="Share of records "
                                 "that `assign: hash` puts in eval.")

    @model_validator(mode="after")
    def _disjoint(self) -> SplitsSpec:
        if self.assign == "hash" and self.train not in (None, self.eval):
            raise ValueError("assign: hash divides one split: train and eval must name the same "
                             "split")
        if self.assign == "split" and self.train == self.eval:
            raise ValueError(f"train and eval name the same records ({self.eval!r}): name "
                             "disjoint splits or slices (train[:80%], train[80%:]), or set "
                             "assign: hash")
        return self


class ShotSpec(Spec):
    """One worked example shown before the question (a user turn and the answer to it)."""

    user: str = Field(max_length=MAX_TEMPLATE_CHARS, description="The example's question.")
    assistant: str = Field(max_length=MAX_TEMPLATE_CHARS, description="Its answer, in the "
                           "format the grader reads.")


class ChoicesSpec(Spec):
    """Lettered options of a multiple-choice record: templates then read `options` (the list,
    in the order shown), `options_text` (`A. ...` lines) and `letter` (the correct one's)."""

    options: str = Field(max_length=MAX_TEMPLATE_CHARS, description="A Jinja2 expression "
                         "giving the record's options as a list, e.g. `[correct_answer, "
                         "distractor1, distractor2]` or `choices.text`.")
    correct: str = Field(max_length=MAX_TEMPLATE_CHARS, description="A Jinja2 expression "
                         "giving the correct option: its index in `options` (an integer), its "
                         "letter (`answerKey`), or its text.")
    shuffle: bool = Field(default=False, description="Show the options in an order shuffled "
                          "per record (seeded by its key): for datasets that list the correct "
                          "option first.")


class TaskFile(Spec):
    """A task declared as data: its dataset, splits, templates and grader."""

    schema_version: int = Field(default=TASK_FILE_SCHEMA_VERSION, description="Version of "
                                "this file format.")
    name: str = Field(pattern=NAME_PATTERN, max_length=100, description="The task's name, e.g. "
                      "`units.conversion`: item ids start with it.")
    version: str = Field(default="1", max_length=40, description="Version of the task's items "
                         "and grading; bump it when either changes (results record it).")
    description: str = Field(default="", max_length=2_000, description="What the task asks.")
    domain: str = Field(default="custom", pattern=r"^[a-z0-9_]+$", max_length=40,
                        description="Domain, e.g. `math`, `science`, `tool_use`, `code`.")
    license: str = Field(default="unknown", max_length=100, description="License of the data.")
    variables: dict[str, str | int | float | bool] = Field(
        default_factory=dict, max_length=32, description="Values the templates read by name, "
        "each also a parameter of the task (a suite's `params: {level: L2}` sets it), e.g. "
        "`{level: L3}`; a record's field of the same name wins in templates.")
    dataset: DatasetSpec = Field(description="Where the records come from.")
    splits: SplitsSpec = Field(description="Training and evaluation splits.")
    filter: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS,
                               description="A Jinja2 expression over a record's fields; records "
                               "for which it is false are skipped (e.g. `level == 'L3'`).")
    key: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS, description="Template "
                            "of a record's stable key (item ids, `assign: hash`, duplicates "
                            "dropped); by default a hash of the rendered prompt.")
    choices: ChoicesSpec | None = Field(default=None, description="Options of a "
                                       "multiple-choice task, shown lettered (with grader "
                                       "`choice`).")
    system: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS, description="Template "
                               "of a system prompt.")
    few_shot: list[ShotSpec] = Field(default_factory=list, max_length=16, description="Worked "
                                     "examples shown before every question, in order.")
    prompt: str = Field(max_length=MAX_TEMPLATE_CHARS, description="Template of the question "
                        "(the user turn), over the record's fields, e.g. `Convert {{ value }} "
                        "{{ unit }} to grams.`")
    answer: str = Field(max_length=MAX_TEMPLATE_CHARS, description="Template of the gold "
                        "answer the grader compares with, e.g. `{{ answer }}`.")
    reference: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS,
                                  description="Template of a correct response (SFT's target, "
                                  "SDPO's demonstration); by default the answer in the grader's "
                                  "format (`\\boxed{A}`, `<answer>A</answer>`, the answer).")
    grader: GraderName = Field(description="How a completion is graded: `boxed_math` (the last "
                               "`\\boxed{}` against the answer, math-equivalent), `choice` (a "
                               "letter), `exact` (the last line, or `grader_args.extract`), "
                               "`regex` (a pattern's group), `tool_calls` (function calls "
                               "against the answer's JSON list of expected calls), "
                               "`code_tests` (the completion's code block run against the "
                               "answer's JSON tests in a sandbox).")
    grader_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the "
                                        "grader (docs/tasks.md lists each grader's).")
    metadata: dict[str, str] = Field(default_factory=dict, description="Templates of fields "
                                     "kept with each item (shown by `clbench tasks show`).")

    @field_validator("variables")
    @classmethod
    def _variable_names(cls, variables: dict[str, Any]) -> dict[str, Any]:
        for name in variables:
            if not name.isidentifier() or name.startswith("_") or name in RESERVED_NAMES:
                raise ValueError(f"{name!r} cannot name a variable: use a name of letters, "
                                 f"digits and _ that is not one of {', '.join(RESERVED_NAMES)}")
        return variables

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != TASK_FILE_SCHEMA_VERSION:
            raise ValueError(f"this clbench reads task file schema_version "
                             f"{TASK_FILE_SCHEMA_VERSION}")
        return v


def read_task_file(path: str | Path) -> TaskFile:
    """Read and validate a task file; its local data file must exist (and match a `sha256` the
    file states), and its SHA-256 is filled in."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such task file")
    document = read_yaml_document(path)
    task: TaskFile = validate_model(TaskFile, document.data, str(path), document)
    if not task.dataset.local:
        return task
    data = data_file(task, path.parent)
    digest = file_sha256(data)
    if task.dataset.sha256 not in (None, digest):
        raise SpecError(f"{path}: dataset.sha256: {data} has SHA-256 {digest}, not the "
                        f"{task.dataset.sha256} the task file states (the data changed: check "
                        "it and bump the task's version)")
    return task.model_copy(update={"dataset": task.dataset.model_copy(update={"sha256": digest})})


def data_file(task: TaskFile, folder: Path) -> Path:
    """The local data file of `task` (relative paths against `folder`, the task file's)."""
    data = Path(task.dataset.path).expanduser()
    data = data if data.is_absolute() else folder / data
    if not data.is_file():
        raise SpecError(f"{task.name}: dataset.path: data file {data} does not exist (relative "
                        "paths resolve against the task file)")
    return data


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
