"""Grading code: the completion's program run against an item's tests in the sandbox.

An item's tests (:class:`CodeTests`) are one of three kinds:
- `asserts`: snippets of Python run after the solution in its namespace (MBPP's `assert f(1) ==
  2`, HumanEval's `check(candidate)` function);
- `stdio`: the solution run as a program on each test's input, its output compared with the
  expected one (whitespace at line ends and the end ignored), as competitive programming grades;
- `functional`: LeetCode style (LiveCodeBench): each input line is a JSON argument of the
  method `entry` of class `Solution` (or of the function `entry`), the result compared with the
  output's JSON.

The tests run in one sandboxed process (:mod:`clbench.tasks.code.sandbox`) by a small harness
that reports with a random token the program does not know, so printing a fake report or exiting
early passes nothing. Feedback names the first failing test and what went wrong, bounded and
stripped of control characters: what SDPO's teacher reads.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from clbench.tasks.base import Grade
from clbench.tasks.code.sandbox import Limits, run_python
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
    blocks = _FENCE.findall(completion[-4 * MAX_CODE_CHARS:])
    blocks = [b for b in blocks if b.strip()]
    return blocks[-1] if blocks else None


def code_start(completion: str) -> int | None:
    """Where the last code block starts (its answer part), or None."""
    starts = [m.start() for m in _FENCE.finditer(completion)]
    return starts[-1] if starts else None


def grade_code(completion: str, tests: CodeTests) -> Grade:
    """Run the completion's code against `tests` in the sandbox: reward 1 when all pass."""
    code = extract_code(completion)
    if code is None:
        return Grade(0.0, False, NO_CODE_FEEDBACK, format_error=True)
    if len(code) > MAX_CODE_CHARS:
        return Grade(0.0, False, f"The code is longer than {MAX_CODE_CHARS:,} characters.")
    token = secrets.token_hex(16)
    outcome = run_python({"solution.py": code, "check.py": HARNESS,
                          "tests.json": json.dumps({"kind": tests.kind, "tests": tests.tests,
                                                    "entry": tests.entry,
                                                    "setup": tests.setup})},
                         "check.py", stdin=token + "\n", limits=tests.limits)
    if outcome.timed_out:
        return Grade(0.0, False, f"Timed out after {tests.limits.wall_s:g} s (an endless loop, "
                     "or too slow).")
    reports = [line[len(token):] for line in outcome.stdout.splitlines()
               if line.startswith(token)]
    if not reports:
        return Grade(0.0, False, _ended_early(outcome.returncode, outcome.stderr))
    try:
        report = json.loads(reports[-1])
    except ValueError:
        return Grade(0.0, False, "The tests could not be run.")
    if report.get("passed") is True:
        return Grade(1.0, True, None)
    return Grade(0.0, False, _feedback(report, tests))


def _ended_early(status: int | None, stderr: str) -> str:
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    if last and ("MemoryError" in last[-1]):
        return "Ran out of memory."
    if status in (128 + 9, 128 + 24):  # SIGKILL, SIGXCPU: the CPU-time limit
        return "Stopped at the CPU-time limit (an endless loop, or too slow)."
    reason = f": {_quote(last[-1])}" if last else ""
    return f"The program ended before its tests ran (exit status {status}){reason}."


def _feedback(report: dict[str, Any], tests: CodeTests) -> str:
    where = report.get("test")
    error = _quote(str(report.get("error") or ""))
    if error.startswith("MemoryError"):
        return "Ran out of memory."
    if where is None:
        return f"The code does not run: {error}." if error else "The code does not run."
    if not isinstance(where, int) or not 0 <= where < len(tests.tests):
        return "A test failed."
    case = tests.tests[where]
    if tests.kind == "asserts":
        text = f"Failed test {where + 1}: {_quote(case)}"
        return f"{text} ({error})." if error and error != "AssertionError" else text + "."
    shown = f"On input {_quote(case['input'])}"
    if error:
        return f"{shown} it raised {error}."
    return (f"{shown} the output was {_quote(str(report.get('got', '')))}, expected "
            f"{_quote(case['output'])}.")


def _quote(text: str) -> str:
    text = printable(" ".join(str(text).split()))
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."


#: Run in the sandbox as `check.py`: reads the report token from its input first, then the
#: tests; runs them; writes one line, the token then a JSON report.
HARNESS = r'''
import contextlib, io, json, os, sys

def _run():
    # what reporting needs, held before the solution runs (it may rebind module attributes)
    token, dumps, loads, leave = sys.stdin.readline().strip(), json.dumps, json.loads, os._exit
    write, flush = sys.__stdout__.write, sys.__stdout__.flush
    with open("tests.json", encoding="utf-8") as f:
        spec = loads(f.read())
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()

    def report(**result):
        write("\n" + token + dumps(result) + "\n")
        flush()
        leave(0)

    def error(exc):
        return (type(exc).__name__ + ": " + str(exc))[:300] if str(exc) else type(exc).__name__

    def same_text(a, b):
        return [l.rstrip() for l in a.strip().splitlines()] == \
            [l.rstrip() for l in b.strip().splitlines()]

    try:
        setup = compile(spec["setup"], "setup", "exec")
        program = compile(source, "solution.py", "exec")
    except BaseException as exc:
        report(passed=False, test=None, error=error(exc))
    if spec["kind"] == "stdio":
        for i, case in enumerate(spec["tests"]):
            sys.stdin = io.StringIO(case["input"])
            captured = io.StringIO()
            try:
                with contextlib.redirect_stdout(captured):
                    space = {"__name__": "__main__"}
                    exec(setup, space)
                    exec(program, space)
            except SystemExit:
                pass
            except BaseException as exc:
                report(passed=False, test=i, error=error(exc))
            if not same_text(captured.getvalue(), case["output"]):
                report(passed=False, test=i, got=captured.getvalue()[:300])
        report(passed=True)
    space = {"__name__": "solution"}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(setup, space)
            exec(program, space)
    except BaseException as exc:
        report(passed=False, test=None, error=error(exc))
    for i, case in enumerate(spec["tests"]):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if spec["kind"] == "asserts":
                    exec(compile(case, "test", "exec"), space)
                    continue
                args = [loads(line) for line in case["input"].splitlines() if line.strip()]
                target = getattr(space["Solution"](), spec["entry"]) \
                    if "Solution" in space else space[spec["entry"]]
                got = target(*args)
        except BaseException as exc:
            report(passed=False, test=i, error=error(exc) if not isinstance(
                exc, AssertionError) or str(exc) else "AssertionError")
        if spec["kind"] == "functional":
            # compared as JSON: an object that claims to equal anything is not JSON
            try:
                same = dumps(got, sort_keys=True) == dumps(loads(case["output"]), sort_keys=True)
            except BaseException:
                same = False
            if not same:
                report(passed=False, test=i, got=repr(got)[:300])
    report(passed=True)

_run()
'''
