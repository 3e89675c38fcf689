"""Tasks declared in task files (:mod:`clbench.spec.taskfile`): records to items, items graded.

A task file becomes a :class:`DeclaredTask` subclass (:func:`declared_task_class`): the same
contract as a task written in Python, so a run, `clbench tasks show` and the lm-eval export treat
both alike. Records are read with `datasets` (a local file, or the hub), filtered, and rendered
through Jinja2's immutable sandbox: templates read a record's fields and call the filters below,
never Python a file names; each rendering is bounded in time and length. Grading is one of
:data:`GRADERS`, chosen by name.

A package ships task files the same way: an entry point in the `clbench.tasks` group naming a
class made by :func:`task_from_file` (clbench's own hub tasks are registered so).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, create_model

from clbench.errors import UserError
from clbench.spec.reading import SpecError
from clbench.spec.taskfile import DATA_FORMATS, TaskFile, data_file, read_task_file
from clbench.tasks.base import (
    Example,
    Grade,
    Messages,
    Split,
    TaskParams,
    TaskSource,
    default_answer_start,
    seeded_rng,
    split_of,
)
from clbench.tasks.grading import (
    MAX_SCAN_CHARS,
    TimeLimitExceeded,
    extract_answer_line,
    extract_boxed,
    extract_tag,
    normalize_answer,
    parse_number,
    quote,
    time_limit,
)
from clbench.tasks.hub import HubDataError, load_split, stable_key
from clbench.tasks.math.generated import boxed_answer_start, grade_boxed
from clbench.tasks.science.generated import grade_choice
from clbench.tasks.tool_use.calls import NO_CALL_FEEDBACK, grade_calls
from clbench.tasks.tool_use.generated import reference_arguments
from clbench.tasks.tool_use.parsing import calls_start

#: One rendering may take this long (on the main thread) and produce this many characters.
RENDER_BUDGET_S = 1.0
MAX_RENDERED_CHARS = 100_000
#: Option letters of multiple-choice tasks.
LETTERS = string.ascii_uppercase
#: A regex grader's pattern gets this long on one completion.
REGEX_BUDGET_S = 0.1


class TaskFileError(UserError):
    """A task file's template or grader arguments fail on a record."""


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


# ---------------------------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------------------------

def _regex_replace(value: Any, pattern: str, replacement: str = "") -> str:
    return re.sub(pattern, replacement, str(value))


def _regex_search(value: Any, pattern: str, group: int = 0) -> str:
    found = re.search(pattern, str(value))
    return found.group(group) if found else ""


def _letter(index: Any) -> str:
    return LETTERS[int(index)]


@lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False,
                                        keep_trailing_newline=False)
    env.filters.update(regex_replace=_regex_replace, regex_search=_regex_search,
                       boxed=lambda v: extract_boxed(str(v)) or "", letter=_letter,
                       hash=lambda *parts: stable_key(*parts))
    return env


class Template:
    """One template (or, with `expression`, one Jinja2 expression) of a task file."""

    def __init__(self, text: str, field: str, task: str, expression: bool = False) -> None:
        from jinja2 import TemplateError

        self.field, self.task = field, task
        try:
            env = _environment()
            self._render = env.compile_expression(text) if expression else \
                env.from_string(text).render
        except TemplateError as exc:
            raise SpecError(f"{task}: {field}: not a valid template: {exc}") from None

    def __call__(self, record: dict[str, Any]) -> Any:
        from jinja2 import TemplateError

        try:
            with time_limit(RENDER_BUDGET_S):
                value = self._render(**record)
        except TemplateError as exc:
            raise TaskFileError(f"{self.task}: {self.field}: {exc}") from None
        except TimeLimitExceeded:
            raise TaskFileError(f"{self.task}: {self.field}: rendering one record took more "
                                f"than {RENDER_BUDGET_S:g} s") from None
        except Exception as exc:  # a filter given the wrong kind of value, say
            raise TaskFileError(f"{self.task}: {self.field}: {type(exc).__name__}: "
                                f"{str(exc)[:200]}") from None
        if isinstance(value, str) and len(value) > MAX_RENDERED_CHARS:
            raise TaskFileError(f"{self.task}: {self.field}: renders {len(value):,} characters "
                                f"(at most {MAX_RENDERED_CHARS:,})")
        return value


# ---------------------------------------------------------------------------------------------
# Graders
# ---------------------------------------------------------------------------------------------

def _exact_extract(how: str) -> Callable[[str], str | None]:
    extractors: dict[str, Callable[[str], str | None]] = {
        "last_line": lambda c: (c.strip().splitlines() or [""])[-1],
        "answer_line": extract_answer_line, "answer_tag": extract_tag, "boxed": extract_boxed,
        "whole": lambda c: c}
    if how not in extractors:
        raise SpecError(f"grader_args.extract: {how!r} is not one of "
                        f"{', '.join(extractors)}")
    return extractors[how]


def _same(pred: str, gold: str, case_sensitive: bool) -> bool:
    if not case_sensitive:
        pred, gold = pred.casefold(), gold.casefold()
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    return pn is not None and pn == gn


class Grader:
    """A grader chosen by name with its arguments, checked when the task is made."""

    ARGS: ClassVar[dict[str, set[str]]] = {
        "boxed_math": set(), "choice": {"letters"},
        "exact": {"extract", "case_sensitive"}, "regex": {"pattern", "group", "ignore_case"},
        "tool_calls": set()}

    def __init__(self, task: TaskFile) -> None:
        self.name, args = task.grader, dict(task.grader_args)
        unknown = set(args) - self.ARGS[self.name]
        if unknown:
            raise SpecError(f"{task.name}: grader_args: {self.name} takes "
                            f"{', '.join(sorted(self.ARGS[self.name])) or 'no arguments'}, "
                            f"not {', '.join(sorted(unknown))}")
        self.letters = str(args.get("letters", "ABCD"))
        if not re.fullmatch(r"[A-Z]{2,26}", self.letters):
            raise SpecError(f"{task.name}: grader_args.letters: capital letters, e.g. ABCD")
        self.extract_name = str(args.get("extract", "last_line")) if self.name == "exact" \
            else ""
        self.extract = _exact_extract(self.extract_name or "last_line")
        self.case_sensitive = bool(args.get("case_sensitive", False))
        self.pattern = None
        if self.name == "regex":
            import regex

            if "pattern" not in args:
                raise SpecError(f"{task.name}: grader_args.pattern: the regex grader needs a "
                                "pattern, e.g. 'Answer: (\\S+)'")
            try:
                self.pattern = regex.compile(str(args["pattern"]),
                                             regex.IGNORECASE if args.get("ignore_case") else 0)
            except regex.error as exc:
                raise SpecError(f"{task.name}: grader_args.pattern: {exc}") from None
            self.group = int(args.get("group", 1 if self.pattern.groups else 0))

    def answer(self, rendered: str) -> Any:
        """The gold answer as the grader holds it (tool calls: the parsed JSON)."""
        if self.name != "tool_calls":
            return rendered.strip()
        try:
            value = json.loads(rendered)
        except ValueError as exc:
            raise TaskFileError(f"answer: the tool_calls grader reads JSON (a list of "
                                f"{{name, arguments}} calls): {exc}") from None
        calls = value.get("calls") if isinstance(value, dict) else value
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str)
                and isinstance(c.get("arguments"), dict) for c in calls):
            raise TaskFileError("answer: the tool_calls grader reads a list of {name, arguments:"
                                " {parameter: [allowed values]}} calls")
        schemas = value.get("schemas", []) if isinstance(value, dict) else []
        return {"calls": calls, "schemas": schemas}

    def reference(self, answer: Any) -> str:
        """A correct response when the file gives no reference template."""
        if self.name == "boxed_math":
            return f"\\boxed{{{answer}}}"
        if self.name == "choice":
            return f"<answer>{answer}</answer>"
        if self.name == "tool_calls":
            return "\n".join(json.dumps({"name": c["name"], "arguments": reference_arguments(
                c["arguments"])}) for c in answer["calls"])
        # exact: where its extractor looks; regex: the answer (a pattern may need a template)
        return {"answer_tag": f"<answer>{answer}</answer>", "answer_line": f"Answer: {answer}",
                "boxed": f"\\boxed{{{answer}}}"}.get(self.extract_name, str(answer))

    def grade(self, gold: Any, completion: str, reveal: bool, letters: str | None = None
              ) -> Grade:
        """`letters`: an item's own (as many as its options), else the grader's."""
        if self.name == "boxed_math":
            return grade_boxed(str(gold), completion, reveal)
        if self.name == "choice":
            return grade_choice(str(gold), completion, reveal, letters=letters or self.letters)
        if self.name == "tool_calls":
            schemas = {s["name"]: s for s in gold.get("schemas", []) if isinstance(s, dict)}
            correct, feedback = grade_calls(completion, gold["calls"], schemas)
            return Grade(1.0 if correct else 0.0, correct, feedback,
                         format_error=feedback == NO_CALL_FEEDBACK)
        pred = self._regex(completion) if self.name == "regex" else self.extract(completion)
        if pred is None or not pred.strip():
            what = "text matching the task's answer pattern" if self.name == "regex" else \
                "answer"
            return Grade(0.0, False, f"No {what} found.", format_error=True)
        if _same(pred, str(gold), self.case_sensitive):
            return Grade(1.0, True, None)
        feedback = f"Your answer {quote(pred)} is wrong."
        if reveal:
            feedback += f" The correct answer is {gold}."
        return Grade(0.0, False, feedback)

    def _regex(self, completion: str) -> str | None:
        assert self.pattern is not None
        try:
            found = list(self.pattern.finditer(completion[-MAX_SCAN_CHARS:],
                                               timeout=REGEX_BUDGET_S))
        except TimeoutError:
            return None
        return found[-1].group(self.group) if found else None

    def answer_start(self, completion: str) -> int:
        if self.name == "boxed_math":
            return boxed_answer_start(completion)
        if self.name == "tool_calls":
            start = calls_start(completion)
            if start is not None:
                return start
        return default_answer_start(completion)


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------

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
                "origin": "offline" if definition.dataset.local else "hub",
                "definition": definition, "folder": Path(folder)})
    return cls  # type: ignore[return-value]


def task_from_file(path: str | Path) -> type[DeclaredTask]:
    """The task source class of a task file: what a package's `clbench.tasks` entry point names
    to ship a task as data (`units = task_from_file(Path(__file__).parent / "units.yaml")`)."""
    path = Path(path)
    return declared_task_class(read_task_file(path), path.resolve().parent)
