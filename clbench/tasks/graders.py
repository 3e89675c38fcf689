"""The graders a task file names: `boxed_math`, `choice`, `exact`, `regex`, `tool_calls` and
`code_tests`, each with its arguments checked when the task is made."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from clbench.spec.reading import SpecError
from clbench.spec.taskfile import TaskFile
from clbench.tasks.base import Grade, default_answer_start
from clbench.tasks.code.grading import CodeTests, code_start, grade_code
from clbench.tasks.code.sandbox import Limits
from clbench.tasks.grading import (
    MAX_SCAN_CHARS,
    extract_answer_line,
    extract_boxed,
    extract_tag,
    normalize_answer,
    parse_number,
    quote,
)
from clbench.tasks.math.generated import boxed_answer_start, grade_boxed
from clbench.tasks.science.generated import grade_choice
from clbench.tasks.templates import TaskFileError
from clbench.tasks.tool_use.calls import NO_CALL_FEEDBACK, grade_calls
from clbench.tasks.tool_use.generated import reference_arguments
from clbench.tasks.tool_use.parsing import calls_start

#: A regex grader's pattern gets this long on one completion.
REGEX_BUDGET_S = 0.1


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
        "tool_calls": set(), "code_tests": {"timeout"}}

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
        self.limits = Limits()
        if "timeout" in args:
            timeout = args["timeout"]
            if not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
                raise SpecError(f"{task.name}: grader_args.timeout: seconds, more than 0 and at "
                                "most 60")
            self.limits = Limits(wall_s=float(timeout), cpu_s=max(1, int(timeout)))
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
            group = args.get("group", 1 if self.pattern.groups else 0)
            if not isinstance(group, int) or not 0 <= group <= self.pattern.groups:
                raise SpecError(f"{task.name}: grader_args.group: {group!r} is not a group of "
                                f"the pattern (it has {self.pattern.groups})")
            self.group = group

    def answer(self, rendered: str) -> Any:
        """The gold answer as the grader holds it (tool calls and code tests: the parsed
        JSON)."""
        if self.name == "code_tests":
            try:
                tests = json.loads(rendered)
                CodeTests.from_answer(tests)
            except ValueError as exc:
                raise TaskFileError(f"answer: the code_tests grader reads JSON {{kind: asserts "
                                    f"| stdio | functional, tests: [...], entry?, setup?}}: "
                                    f"{exc}") from None
            return tests
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
        if self.name == "code_tests":  # a solution cannot be made from tests
            return ""
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
        if self.name == "code_tests":
            tests = CodeTests.from_answer(gold)
            return grade_code(completion, replace(tests, limits=self.limits))
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
        if self.name == "code_tests":
            start = code_start(completion)
            if start is not None:
                return start
        if self.name == "tool_calls":
            start = calls_start(completion)
            if start is not None:
                return start
        return default_answer_start(completion)
