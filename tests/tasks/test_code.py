"""The code domain: completions run against tests in the sandbox. Hostile code (an endless loop,
a fork bomb, writes outside its folder, a socket, a fake report) is graded false within seconds
and leaves no process or folder behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fakes import run_cli
from where import FIXTURES

from clbench.tasks import shipped
from clbench.tasks.base import grade_all
from clbench.tasks.code import sandbox
from clbench.tasks.code.generated import FAMILIES, GeneratedCode
from clbench.tasks.code.grading import NO_CODE_FEEDBACK, CodeTests, grade_code

ADD = CodeTests("asserts", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"])
BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None,
                           reason="needs Debian's bubblewrap (`.ci/run` installs it)")


def block(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\n"


def sandbox_leftovers() -> tuple[list[str], list[int]]:
    """Sandbox folders still on disk, and processes still running a sandbox's harness or
    launcher, or running as a sandbox's user."""
    folders = [p.name for p in Path(tempfile.gettempdir()).glob("clbench-sandbox-*")]
    running = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            uid = int((entry / "status").read_text().split("Uid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if (b"main.py" in cmdline and b"-I" in cmdline) or b"PR_SET_CHILD_SUBREAPER" in cmdline \
                or uid >= sandbox.SANDBOX_UID:
            running.append(int(entry.name))
    return folders, running


@pytest.mark.parametrize(("completion", "correct", "feedback"), [
    (block("def add(a, b):\n    return a + b"), True, None),
    (block("def add(a, b):\n    return a - b"), False,
     "Failed test 1: assert add(2, 3) == 5 (got -1)."),
    ("def add(a, b): return a + b", False, NO_CODE_FEEDBACK),
    (block("def add(a b):"), False, "The code does not run: SyntaxError: invalid syntax "
     "(solution.py, line 1)."),
    (block("def add(a, b):\n    return (a + b) / 0"), False,
     "Failed test 1: assert add(2, 3) == 5 (ZeroDivisionError: division by zero)."),
])
def test_a_completion_is_graded_by_running_its_tests(completion: str, correct: bool,
                                                     feedback: str | None) -> None:
    grade = grade_code(completion, ADD)
    assert (grade.correct, grade.feedback) == (correct, feedback)
    assert grade.format_error is (feedback == NO_CODE_FEEDBACK)


def test_stdio_and_functional_tests() -> None:
    stdio = CodeTests("stdio", [{"input": "1 2\n", "output": "3\n"},
                                {"input": "10 -4", "output": "6"}])
    assert grade_code(block("a, b = map(int, input().split())\nprint(a + b)"), stdio).correct
    wrong = grade_code(block("a, b = map(int, input().split())\nprint(a * b)"), stdio)
    assert wrong.feedback == "On input 1 2 the output was 2, expected 3."
    functional = CodeTests("functional", [{"input": "[1, 5, 7]\n4", "output": "2"}],
                           entry="countGreater")
    solution = ("class Solution:\n    def countGreater(self, nums, k):\n"
                "        return sum(v > k for v in nums)")
    assert grade_code(block(solution), functional).correct
    # an object that claims to equal anything is not the expected JSON
    cheat = ("class Any:\n    def __eq__(self, other):\n        return True\n"
             "class Solution:\n    def countGreater(self, nums, k):\n        return Any()")
    assert not grade_code(block(cheat), functional).correct


@pytest.mark.parametrize(("name", "code", "feedback"), [
    ("endless loop", "while True:\n    pass", "Timed out|CPU-time limit"),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
     "        pass", "Timed out|CPU-time limit"),
    ("memory", "x = bytearray(4 * 1024 ** 3)", "Ran out of memory"),
    ("exits before the tests", "import os\nos._exit(0)", "The program ended before its tests"),
    ("a fake report", "import sys\nprint('0' * 32 + '{\"passed\": true}')\nsys.stdout.flush()\n"
     "import os\nos._exit(0)", "The program ended before its tests"),
    ("sys.exit", "import sys\nsys.exit(0)", "SystemExit"),
])
def test_hostile_code_is_graded_false_in_seconds_and_leaves_nothing(
        name: str, code: str, feedback: str) -> None:
    tests = CodeTests("asserts", ["assert True"], limits=sandbox.Limits(wall_s=3, cpu_s=2))
    start = time.monotonic()
    grade = grade_code(block(code), tests)
    assert not grade.correct and re.search(feedback, grade.feedback), grade.feedback
    assert time.monotonic() - start < 10
    assert sandbox_leftovers() == ([], [])


@BWRAP
def test_under_bubblewrap_code_writes_only_its_folder_and_has_no_network(tmp_path: Path) -> None:
    assert sandbox.sandbox_kind() == "bubblewrap"
    target = tmp_path / "written-by-the-sandbox"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    connected = []
    threading.Thread(target=lambda: connected.append(server.accept()), daemon=True).start()
    try:
        escape = grade_code(block(f"open({str(target)!r}, 'w').write('x')"), ADD)
        network = grade_code(block(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"), ADD)
        secret = grade_code(block("print(open('/root/.bashrc').read())\n"
                                  "def add(a, b):\n    return a + b"), ADD)
    finally:
        server.close()
    assert not target.exists() and not escape.correct
    assert not network.correct and not connected
    assert "Network is unreachable" in network.feedback or "refused" in network.feedback
    assert not secret.correct  # the host's files are not there to read
    own = grade_code(block("open('scratch.txt', 'w').write('fine')\n"
                           "def add(a, b):\n    return a + b"), ADD)
    assert own.correct  # its own folder it may write
    assert sandbox_leftovers() == ([], [])


def test_the_rlimits_fallback_still_bounds_time_processes_and_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bubblewrap the limits still hold (the filesystem and network do not: docs)."""
    python = sandbox._setup()[1]
    monkeypatch.setattr(sandbox, "_setup", lambda: ("rlimits", python))
    limits = sandbox.Limits(wall_s=3, cpu_s=2)
    escape = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
              "assert False")  # a process that leaves the sandbox's session, and lingers
    for code in ("while True:\n    pass", "import os\nwhile True:\n    try:\n        os.fork()\n"
                 "    except OSError:\n        pass", "x = bytearray(4 * 1024 ** 3)", escape):
        assert not grade_code(block(code), CodeTests("asserts", ["assert True"],
                                                     limits=limits)).correct
    assert grade_code(block("def add(a, b):\n    return a + b"), ADD).correct
    assert sandbox_leftovers() == ([], [])


def test_feedback_is_bounded_and_printable() -> None:
    long_test = "assert f() == '" + "\x1b[31m" + "x" * 5000 + "'"
    grade = grade_code(block("def f():\n    return 1"), CodeTests("asserts", [long_test]))
    assert not grade.correct and len(grade.feedback) < 250
    assert "\x1b" not in grade.feedback


def test_generated_items_are_drawn_deterministically_and_their_references_pass() -> None:
    task = GeneratedCode()
    items = task.examples("eval", 0, 12)
    assert items == GeneratedCode().examples("eval", 0, 12)
    assert task.examples("eval", 0, 20)[:12] == items
    assert not {e.id for e in items} & {e.id for e in task.examples("train", 0, 200)}
    grades = grade_all([(task, e, e.reference) for e in items])
    assert all(g.correct for g in grades)
    first = items[0]
    shown = first.messages[-1]["content"]
    assert "```python" in shown and shown.count("assert ") == 1  # one test shown
    assert not any(t in shown for t in first.answer["tests"])    # the graded ones hidden
    assert {e.metadata["family"] for e in task.examples("eval", 0, 60)} == {
        "count_where", "sum_multiples", "keep_words", "scale_list"}  # the `lists` mix


def test_grade_all_keeps_the_order_of_mixed_tasks() -> None:
    from clbench.tasks.math.generated import Arithmetic

    code, math = GeneratedCode(), Arithmetic()
    c1, c2 = code.examples("eval", 1, 2)
    m1 = math.examples("eval", 1, 1)[0]
    grades = grade_all([(code, c1, c1.reference), (math, m1, "\\boxed{-1}"),
                        (code, c2, "no code"), (math, m1, m1.reference)])
    assert [g.correct for g in grades] == [True, False, False, True]


def test_a_family_that_does_not_exist_is_refused_with_the_known_ones() -> None:
    from clbench.plugins import registry
    from clbench.spec.reading import SpecError
    from clbench.spec.schema import TaskSpec

    with pytest.raises(SpecError, match="unknown family loops; choose from " +
                       ", ".join(FAMILIES)):
        registry.build_task(TaskSpec(source="code.generated", params={"families": ["loops"]}))


def fx(name: str) -> str:
    return str(FIXTURES / "hub" / name)


@pytest.mark.parametrize(("task", "params", "solved"), [
    (shipped.MBPP, {"data_files": {"train": fx("mbpp_train.jsonl"),
                                   "test": fx("mbpp_test.jsonl")}}, 3),
    (shipped.HumanEval, {"data_files": fx("humaneval_test.jsonl")}, 2),
    (shipped.DolciCode, {"data_files": fx("dolci_code.jsonl")}, None),
])
def test_code_task_files_grade_their_reference_solutions(task, params, solved) -> None:
    source = task(params)
    items = source.items("eval")
    if solved is not None:
        assert len(items) == solved
    assert items and all(source.grade(e, e.reference).correct for e in items)
    assert not any(source.grade(e, block("pass")).correct for e in items)


def test_humaneval_solutions_may_use_the_imports_of_its_prompt() -> None:
    source = shipped.HumanEval({"data_files": fx("humaneval_test.jsonl")})
    longest = next(e for e in source.items("eval") if e.id.endswith("HumanEval/1"))
    assert source.grade(longest, block(
        "def longest(words: List[str]) -> str:\n    return max(words, key=len, default='')"
    )).correct


def test_dolci_keeps_code_records_only_and_splits_them_by_hash() -> None:
    source = shipped.DolciCode({"data_files": fx("dolci_code.jsonl")})
    ids = {e.id for e in source.items("train")} | {e.id for e in source.items("eval")}
    assert len(ids) == 6 and not any("math" in i for i in ids)


def test_livecodebench_runs_stdio_and_leetcode_problems_on_their_public_tests() -> None:
    source = shipped.LiveCodeBench({"data_files": fx("livecodebench_test.jsonl")})
    items = {e.metadata["platform"]: e for e in source.items("eval")}
    atcoder, leetcode = items["atcoder"], items["leetcode"]
    assert "standard input" in atcoder.messages[-1]["content"]
    assert "class Solution" in leetcode.messages[-1]["content"]
    assert source.grade(atcoder, block("a, b = map(int, input().split())\nprint(a + b)")).correct
    assert source.grade(leetcode, block(  # as its starter code: typing names imported
        "class Solution:\n    def countGreater(self, nums: List[int], k: int) -> int:\n"
        "        return len([v for v in nums if v > k])")).correct
    assert not source.grade(leetcode, block(
        "class Solution:\n    def countGreater(self, nums, k):\n        return 0")).correct


def test_tasks_grade_runs_code(tmp_path: Path) -> None:
    item = GeneratedCode().examples("eval", 1234, 1)[0]
    answer = tmp_path / "answer.txt"
    answer.write_text(item.reference)
    result = run_cli(["tasks", "grade", "code.generated", "--index", "0", "--completion-file",
                      str(answer), "--json"])
    assert json.loads(result.output)["correct"] is True
    answer.write_text(block("while True:\n    pass"))
    result = run_cli(["tasks", "grade", "code.generated", "--index", "0", "--completion-file",
                      str(answer)])
    assert "correct: false" in result.output
    assert re.search("Timed out|CPU-time limit", result.output)
    shown = run_cli(["tasks", "show", "code.generated", "--n", "2"])
    assert shown.exit_code == 0 and shown.output.count("grade of the reference: reward 1.000") == 2
    assert os.path.exists(answer)


CHEATS = {
    "an object equal to everything": "class Any:\n    def __eq__(self, other):\n"
                                     "        return True\ndef add(a, b):\n    return Any()",
    "a subclass of int equal to everything": "class Any(int):\n    def __eq__(self, other):\n"
                                             "        return True\ndef add(a, b):\n"
                                             "    return Any(0)",
    "reporting through the harness's own frames": (
        "import sys\nframe = sys._getframe()\nwhile frame and 'report' not in frame.f_locals:\n"
        "    frame = frame.f_back\nfor i in range(2):\n"
        "    frame.f_locals['report'](test=i, ok=True)\nimport os\nos._exit(0)"),
    "reading the tests": "import os\nfound = [open(n).read() for n in os.listdir('.')]\n"
                         "def add(a, b):\n    return found",
    "patching json": "import json\njson.dumps = lambda *a, **k: '5'\n"
                     "def add(a, b):\n    return 0",
}


@pytest.mark.parametrize("code", CHEATS.values(), ids=CHEATS.keys())
def test_a_solution_cannot_forge_a_pass(code: str) -> None:
    """The expected values never enter the sandbox; what comes back must be a plain value."""
    assert not grade_code(block(code), ADD).correct
    assert sandbox_leftovers() == ([], [])
