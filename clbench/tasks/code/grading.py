"""Grading code: the completion's program run against an item's tests in the sandbox.

An item's tests (:class:`CodeTests`) are one of three kinds:
- `asserts`: snippets of Python run after the solution in its namespace (MBPP's `assert f(1) ==
  2`, HumanEval's `check(candidate)` function);
- `stdio`: the solution run as a program on each test's input, its output compared with the
  expected one (whitespace at line ends and the end ignored), as competitive programming grades;
- `functional`: LeetCode style (LiveCodeBench): each input line is a JSON argument of the
  method `entry` of class `Solution` (or of the function `entry`), the result compared with the
  output's JSON.

clbench judges every test it can itself, outside the sandbox: an assert of the form `assert
EXPR == LITERAL` is run as EXPR, its value reported and compared here with the literal; outputs
and results likewise; the sandbox never sees those expected values, and a value of anything but
builtin types (an object that claims to equal anything) is not a value. Only other asserts
(HumanEval's `check`, `math.isclose(...)`) are judged inside, by whether they raise. Feedback
names the first failing test and what went wrong, bounded and stripped of control characters:
what SDPO's teacher reads.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from clbench.tasks.base import Grade
from clbench.tasks.code.harness import HARNESS, plain
from clbench.tasks.code.sandbox import Limits, Outcome, run_python
from clbench.text import printable

NO_CODE_FEEDBACK = "No code found; write the solution in a ```python code block."
#: Feedback quotes at most this many characters of a test, an input or an output.
QUOTE_CHARS = 160
#: A completion's code longer than this is not run.
MAX_CODE_CHARS = 50_000
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


@dataclass(frozen=True)
class CodeTests:
    """What a solution must pass."""

    kind: Literal["asserts", "stdio", "functional"]
    tests: list[Any]
    entry: str | None = None
    setup: str = ""
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_answer(cls, answer: Any) -> CodeTests:
        """From an item's answer: a mapping `{kind, tests, entry?, setup?}`."""
        if not isinstance(answer, dict) or answer.get("kind") not in ("asserts", "stdio",
                                                                       "functional"):
            raise ValueError("code tests are a mapping with kind asserts, stdio or functional")
        tests = answer.get("tests")
        if not isinstance(tests, list) or not tests:
            raise ValueError("code tests need a non-empty list of tests")
        if answer["kind"] == "asserts" and not all(isinstance(t, str) for t in tests):
            raise ValueError("asserts tests are snippets of Python")
        if answer["kind"] != "asserts" and not all(
                isinstance(t, dict) and isinstance(t.get("input"), str)
                and isinstance(t.get("output"), str) for t in tests):
            raise ValueError(f"{answer['kind']} tests are {{input, output}} strings")
        if answer["kind"] == "functional" and not answer.get("entry"):
            raise ValueError("functional tests name their entry (the method to call)")
        return cls(answer["kind"], tests, answer.get("entry"), str(answer.get("setup") or ""))


def extract_code(completion: str) -> str | None:
    """The last fenced code block (```python ... ```; an unclosed last block to the end),
    else None."""
    blocks = [b for b in _FENCE.findall(completion[-4 * MAX_CODE_CHARS:]) if b.strip()]
    return blocks[-1] if blocks else None


def code_start(completion: str) -> int | None:
    """Where the last code block starts (its answer part), or None."""
    starts = [m.start() for m in _FENCE.finditer(completion)]
    return starts[-1] if starts else None


@dataclass(frozen=True)
class _Check:
    """One test: what the sandbox runs (`sent`) and what clbench expects back (`expected`, None
    for a snippet judged inside by whether it raises)."""

    sent: dict[str, str]
    expected: Any = None


def grade_code(completion: str, tests: CodeTests) -> Grade:
    """Run the completion's code against `tests` in the sandbox: reward 1 when all pass."""
    code = extract_code(completion)
    if code is None:
        return Grade(0.0, False, NO_CODE_FEEDBACK, format_error=True)
    if len(code) > MAX_CODE_CHARS:
        return Grade(0.0, False, f"The code is longer than {MAX_CODE_CHARS:,} characters.")
    checks = [_check(tests.kind, test) for test in tests.tests]
    token = secrets.token_hex(16)
    plan = {"setup": tests.setup, "solution": code, "kind": tests.kind, "entry": tests.entry,
            "tests": [c.sent for c in checks]}
    outcome = run_python(HARNESS, stdin=token + "\n" + json.dumps(plan), limits=tests.limits)
    reports = _reports(outcome, token)
    start = reports.get("start")
    if start is None:
        return Grade(0.0, False, _stopped(outcome, tests.limits, None))
    failure = start.get("error") if not start.get("ran") else \
        reports[None].get("error") if None in reports else None  # compiling, defining it
    if failure is not None:
        return Grade(0.0, False, "Ran out of memory." if str(failure).startswith("MemoryError")
                     else f"The code does not run: {_quote(failure)}.")
    for i, (check, test) in enumerate(zip(checks, tests.tests)):
        result = reports.get(i)
        if result is None:
            return Grade(0.0, False, _stopped(outcome, tests.limits, i))
        problem = _judge(tests.kind, check, test, result)
        if problem is not None:
            return Grade(0.0, False, problem)
    return Grade(1.0, True, None)


def _check(kind: str, test: Any) -> _Check:
    if kind == "stdio":
        return _Check({"input": test["input"]}, test["output"])
    if kind == "functional":
        try:
            expected = plain(json.loads(test["output"]), lists=True)
        except (ValueError, TypeError, RecursionError):
            expected = None
        return _Check({"args": test["input"]}, expected)
    split = _split_assert(test)
    if split is None:
        return _Check({"code": test})
    expr, value = split
    return _Check({"expr": expr}, plain(value))


def _split_assert(test: str) -> tuple[str, Any] | None:
    """`(EXPR, LITERAL's value)` of a test that is `assert EXPR == LITERAL` (or `LITERAL ==
    EXPR`), else None."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    compare = tree.body[0].test
    if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1
            and isinstance(compare.ops[0], ast.Eq)):
        return None
    for expr, literal in ((compare.left, compare.comparators[0]),
                          (compare.comparators[0], compare.left)):
        try:
            value = ast.literal_eval(literal)
            plain(value)  # bytes, complex numbers...: judged inside, by the assert itself
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return ast.unparse(expr), value
    return None


def _reports(outcome: Outcome, token: str) -> dict[Any, dict[str, Any]]:
    """The harness's reports by test index (`start` for the first, None for the solution's
    definition)."""
    found: dict[Any, dict[str, Any]] = {}
    for line in outcome.stdout.splitlines():
        if not line.startswith(token):
            continue
        try:
            report = json.loads(line[len(token):])
        except ValueError:
            continue
        if not isinstance(report, dict):
            continue
        if "ran" in report:
            found.setdefault("start", report)
        elif "test" in report and report["test"] not in found:
            found[report["test"]] = report
    return found


def _judge(kind: str, check: _Check, test: Any, result: dict[str, Any]) -> str | None:
    """None when the test passed, else the feedback."""
    error = result.get("error")
    if kind == "asserts":
        shown = f"Failed test {result['test'] + 1}: {_quote(test)}"
        if error is not None:
            if str(error).startswith("MemoryError"):
                return "Ran out of memory."
            return f"{shown}." if error == "AssertionError" else f"{shown} ({_quote(error)})."
        if "expr" in check.sent and ("value" not in result or
                                     _decoded(result["value"]) != _decoded(check.expected)):
            return f"{shown} (got {_quote(_python(result.get('value')))})."
        return None
    where = f"On input {_quote(test['input'])}"
    if error is not None:
        return "Ran out of memory." if str(error).startswith("MemoryError") else \
            f"{where} it raised {_quote(error)}."
    if kind == "stdio":
        output = str(result.get("output", ""))
        if _same_text(output, str(check.expected)):
            return None
        return f"{where} the output was {_quote(output)}, expected {_quote(check.expected)}."
    if check.expected is not None and "value" in result and \
            _decoded(result["value"]) == _decoded(check.expected):
        return None
    return (f"{where} the result was {_quote(_python(result.get('value')))}, expected "
            f"{_quote(test['output'])}.")


def _decoded(value: Any) -> Any:
    """A plain value as JSON reads it back (what the harness's report went through)."""
    return json.loads(json.dumps(value))


def _same_text(a: str, b: str) -> bool:
    return [line.rstrip() for line in a.strip().splitlines()] == \
        [line.rstrip() for line in b.strip().splitlines()]


def _python(value: Any) -> str:
    """A plain value written as Python writes it."""
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "tuple" and isinstance(inner, list):
            items = [_python(v) for v in inner]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if tag == "set" and isinstance(inner, list):
            return "{" + ", ".join(_python(v) for v in inner) + "}" if inner else "set()"
        if tag == "dict" and isinstance(inner, list):
            return "{" + ", ".join(f"{_python(k)}: {_python(v)}" for k, v in inner) + "}"
        if tag == "float":
            return f"float({inner!r})"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    return repr(value)


def _stopped(outcome: Outcome, limits: Limits, test: int | None) -> str:
    """Feedback for a run that reported nothing on `test` (None: nothing at all)."""
    on = f" on test {test + 1}" if test is not None else ""
    if outcome.timed_out:
        return f"Timed out{on} after {limits.wall_s:g} s (an endless loop, or too slow)."
    if outcome.returncode in (128 + 9, 128 + 24):  # SIGKILL, SIGXCPU: the CPU-time limit
        return f"Stopped at the CPU-time limit{on} (an endless loop, or too slow)."
    last = [line for line in outcome.stderr.strip().splitlines() if line.strip()]
    if last and "MemoryError" in last[-1]:
        return "Ran out of memory."
    reason = f": {_quote(last[-1])}" if last else ""
    return f"The program ended before its tests ran{on} (exit status {outcome.returncode})" \
        f"{reason}."


def _quote(text: Any) -> str:
    text = printable(" ".join(str(text).split()))
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."
