"""Tasks declared in task files (:mod:`clbench.spec.taskfile`): records to items, items graded.

A task file becomes a :class:`DeclaredTask` subclass (:func:`declared_task_class`): the same
contract as a task written in Python, so a run, `clbench tasks show` and the lm-eval export treat
both alike. Records are read with `datasets` (a local file, or the hub), filtered, and rendered
through the file's templates (:mod:`clbench.tasks.templates`); grading is one of the graders a
file may name (:mod:`clbench.tasks.graders`).

A package ships task files the same way: an entry point in the `clbench.tasks` group naming a
class made by :func:`task_from_file` (clbench's own hub tasks are registered so).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, create_model

from clbench.spec.taskfile import DATA_FORMATS, TaskFile, data_file, read_task_file
from clbench.tasks.base import (
    Example,
    Grade,
    Messages,
    Split,
    TaskParams,
    TaskSource,
    seeded_rng,
    split_of,
)
from clbench.tasks.graders import Grader
from clbench.tasks.hub import HubDataError, load_split
from clbench.tasks.templates import LETTERS, RecordTooLong, TaskFileError, Template


class DeclaredParams(TaskParams):
    """Parameters of every task declared in a file."""

    data_files: str | dict[str, str] | None = Field(
        default=None, description="Local file(s) in the dataset's record format read instead of "
        "the file's dataset (nothing is downloaded): one file for every split the task names, "
        "or a mapping from split name (`train`, `test`) to file.")
    name: str | None = Field(default=None, description="Hub dataset configuration (subset) "
                             "instead of the task file's.")
    revision: str | None = Field(default=None, description="Hub dataset revision (branch, tag "
                                 "or commit) instead of the task file's.")
    reveal_answer_in_feedback: bool = Field(default=False, description="Let the grader's "
                                            "feedback state the gold answer.")


class DeclaredTask(TaskSource):
    """A task declared in a task file; subclasses made by :func:`declared_task_class` carry it."""

    Params: ClassVar[type[TaskParams]] = DeclaredParams
    definition: ClassVar[TaskFile]
    folder: ClassVar[Path]
    params: DeclaredParams

    def __init__(self, params: TaskParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        d = self.definition
        self.grader = Grader(d)
        self.templates = {field: Template(getattr(d, field), field, d.name)
                          for field in ("prompt", "answer", "system", "key", "reference")
                          if getattr(d, field) is not None}
        self.metadata_templates = {k: Template(v, f"metadata.{k}", d.name)
                                   for k, v in d.metadata.items()}
        self.keep = Template(d.filter, "filter", d.name, expression=True) if d.filter else None
        self.choices = None if d.choices is None else (
            Template(d.choices.options, "choices.options", d.name, expression=True),
            Template(d.choices.correct, "choices.correct", d.name, expression=True))

    @classmethod
    def content_digest(cls) -> str | None:
        return hashlib.sha256(cls.definition.model_dump_json().encode()).hexdigest()[:16]

    # -- records ------------------------------------------------------------------------------

    def _records(self, expression: str, split: Split) -> tuple[list[dict[str, Any]], bool]:
        """The records of `expression` (a split of the dataset), and whether they are `split`'s
        as they are: `data_files` given per clbench split (`{train: ..., eval: ...}`) are read
        whole, neither sliced nor divided by hash."""
        d, p, files = self.definition.dataset, self.params, self.params.data_files
        if files is None and d.local:
            files = str(data_file(self.definition, self.folder))
        if files is None:
            return load_split(d.path, p.name or d.name, expression,
                              p.revision or d.revision), False
        names, whole = _split_names(expression), False
        if isinstance(files, str):
            files = {name: files for name in names}
        elif not all(name in files for name in names) and split in files:
            files, expression, names, whole = {"train": files[split]}, "train", ["train"], True
        missing = [name for name in names if name not in files]
        if missing:
            raise HubDataError(f"{self.name}: data_files has no {missing[0]!r} entry (keys: "
                               f"{', '.join(sorted(files))}; the dataset's split names or "
                               "train and eval)")
        for f in files.values():
            if not Path(f).is_file():
                raise HubDataError(f"{self.name}: data file {f} does not exist")
        suffixes = {Path(f).suffix.lower() for f in files.values()}
        if len(suffixes) != 1 or next(iter(suffixes)) not in DATA_FORMATS:
            raise HubDataError(f"{self.name}: data files must be one of "
                               f"{', '.join(DATA_FORMATS)}, all of one kind")
        return load_split(DATA_FORMATS[suffixes.pop()], None, expression, None, files), whole

    def variables(self) -> dict[str, Any]:
        """The task file's variables with this task's parameters for them."""
        return {k: getattr(self.params, k) for k in self.definition.variables}

    def item(self, record: dict[str, Any]) -> tuple[str, Example] | None:
        """`(key, example)` of one record, or None when the file's filter skips it. Templates
        see the record's fields by name, the whole record as `record` (for names that are not
        identifiers) and, with `choices`, `options`, `options_text` and `letter`."""
        record = {**self.variables(), **record, "record": record}
        if self.keep is not None and not self.keep(record):
            return None
        t = self.templates
        metadata: dict[str, Any] = {}
        if self.choices is not None:
            record = self._with_options(record)
            metadata["letters"] = LETTERS[:len(record["options"])]
        prompt = str(t["prompt"](record))
        answer = self.grader.answer(str(t["answer"](record)))
        reference = str(t["reference"](record)) if "reference" in t else \
            self.grader.reference(answer)
        key = str(t["key"](record)) if "key" in t else \
            hashlib.sha256(prompt.encode()).hexdigest()[:16]
        messages: Messages = []
        if "system" in t:
            messages.append({"role": "system", "content": str(t["system"](record))})
        for shot in self.definition.few_shot:
            messages += [{"role": "user", "content": shot.user},
                         {"role": "assistant", "content": shot.assistant}]
        messages.append({"role": "user", "content": prompt})
        metadata.update({k: str(v(record)) for k, v in self.metadata_templates.items()})
        return key, Example(id=f"{self.name}:{key}", messages=messages, reference=reference,
                            answer=answer, metadata=metadata)

    def _with_options(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with its options (shuffled if the file says so), their lettered lines and
        the correct one's letter."""
        assert self.choices is not None and self.definition.choices is not None
        options_of, correct_of = self.choices
        options = options_of(record)
        if not isinstance(options, (list, tuple)) or not 2 <= len(options) <= len(LETTERS):
            raise TaskFileError(f"{self.name}: choices.options: expected a list of 2 to "
                                f"{len(LETTERS)} options, got {str(options)[:80]}")
        options = [str(o).strip() for o in options]
        correct = correct_of(record)
        if isinstance(correct, int) and 0 <= correct < len(options):
            index = correct
        elif isinstance(correct, str) and len(correct) == 1 and \
                correct in LETTERS[:len(options)] and correct not in options:
            index = LETTERS.index(correct)
        elif str(correct).strip() in options:
            index = options.index(str(correct).strip())
        else:
            raise TaskFileError(f"{self.name}: choices.correct: {str(correct)[:80]!r} is not "
                                "an index, a letter or the text of one of the options")
        if self.definition.choices.shuffle:
            key = str(self.templates["key"](record)) if "key" in self.templates else \
                json.dumps(record["record"], sort_keys=True, default=str)
            shuffled = list(options)
            seeded_rng("options", key).shuffle(shuffled)
            index = shuffled.index(options[index])
            options = shuffled
        return {**record, "options": options, "letter": LETTERS[index],
                "options_text": "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))}

    def items(self, split: Split) -> list[Example]:
        """Every usable item of `split`, in record order, a key seen twice kept once; a
        training item never shares its key with an evaluation item."""
        splits = self.definition.splits
        if split == "train" and splits.train is None:
            raise HubDataError(f"{self.name} is an evaluation-only benchmark; it has no train "
                               "split (use it as a probe, or train on another task)")
        expression = splits.eval if split == "eval" or splits.assign == "hash" else splits.train
        assert expression is not None
        records, whole = self._records(expression, split)
        by_hash = splits.assign == "hash" and not whole
        out: dict[str, Example] = {}
        for index, record in enumerate(records):
            try:
                made = self.item(record)
            except RecordTooLong:
                continue
            except TaskFileError as exc:
                raise TaskFileError(f"record {index} of split {expression!r}: {exc}") from None
            if made is None or made[0] in out:
                continue
            if by_hash and split_of(made[0], splits.eval_fraction) != split:
                continue
            out[made[0]] = made[1]
        if split == "train" and not by_hash:
            held_out = {ex.id for ex in self.items("eval")}
            out = {k: ex for k, ex in out.items() if ex.id not in held_out}
        return list(out.values())

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        """The first `size` items of a seeded shuffle (all of them if fewer exist): a larger
        size draws the same items first."""
        items = self.items(split)
        if not items and size > 0:
            raise HubDataError(f"{self.name}: no usable {split} records (check the task file's "
                               "splits and filter)")
        seeded_rng(self.name, self.params.draw_key(), split, seed).shuffle(items)
        return items[:size]

    def grade(self, example: Example, completion: str) -> Grade:
        return self.grader.grade(example.answer, completion,
                                 self.params.reveal_answer_in_feedback,
                                 example.metadata.get("letters"))

    def answer_start(self, completion: str) -> int:
        return self.grader.answer_start(completion)


def _split_names(expression: str) -> list[str]:
    """The split names of a `datasets` split expression: `train[:80%]+test` -> train, test."""
    return [re.split(r"[\[(]", part, maxsplit=1)[0].strip() for part in expression.split("+")]


_CLASSES: dict[tuple[str, str], type[DeclaredTask]] = {}


def declared_task_class(definition: TaskFile, folder: str | Path) -> type[DeclaredTask]:
    """The task source class of a task file's content (`folder`: where the file is)."""
    key = (definition.model_dump_json(), str(folder))
    cls = _CLASSES.get(key)
    if cls is None:
        params = create_model(  # type: ignore[call-overload]
            f"Params[{definition.name}]", __base__=DeclaredParams,
            **{k: (type(v), Field(default=v, description=f"Task file variable ({v!r} unless "
                                  "set).")) for k, v in definition.variables.items()})
        cls = _CLASSES[key] = type(  # type: ignore[assignment]
            f"Declared[{definition.name}]", (DeclaredTask,), {"Params": params,
                "name": definition.name, "description": definition.description,
                "domain": definition.domain, "version": definition.version,
                "license": definition.license,
                "grades_in_parallel": definition.grader == "code_tests",
                "runs_code": definition.grader == "code_tests",
                "origin": "offline" if definition.dataset.local else "hub",
                "definition": definition, "folder": Path(folder)})
    return cls  # type: ignore[return-value]


def task_from_file(path: str | Path) -> type[DeclaredTask]:
    """The task source class of a task file: what a package's `clbench.tasks` entry point names
    to ship a task as data (`units = task_from_file(Path(__file__).parent / "units.yaml")`)."""
    path = Path(path)
    return declared_task_class(read_task_file(path), path.resolve().parent)
