"""The program that runs a solution against its tests inside the sandbox.

It reads, on its input, a report token and then a plan: the setup, the solution, and per test
what to run (an expression whose value to report, a snippet that must run without error, an
input to run the program on, or the arguments of a call). It reports one line per test, the
token then JSON: the value (as :func:`plain` writes it), the output, or the error. It is given
no expected value of a test that clbench judges itself (:mod:`clbench.tasks.code.grading`), so
what a solution can do to the harness, it cannot turn into a pass it did not earn.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any


def plain(value: Any, lists: bool = False, depth: int = 0) -> Any:
    """`value` as JSON if it is made of builtin types only (exactly those types: a subclass
    could claim to equal anything): tuples, sets, dicts and floats JSON cannot hold are tagged
    (tuples are lists with `lists`). Anything else raises TypeError."""
    kind = type(value)
    if depth > 32:
        raise TypeError("nested more than 32 levels deep")
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list or (kind is tuple and lists):
        return [plain(v, lists, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [plain(v, lists, depth + 1) for v in value]}
    if kind is set or kind is frozenset:
        return {"set": sorted((plain(v, lists, depth + 1) for v in value), key=json.dumps)}
    if kind is dict:
        return {"dict": sorted(([plain(k, lists, depth + 1), plain(v, lists, depth + 1)]
                                for k, v in value.items()), key=lambda kv: json.dumps(kv[0]))}
    raise TypeError(f"a {kind.__name__} is not a plain value")


_PROGRAM = r'''from __future__ import annotations
import builtins, contextlib, io, json, math, os, sys

def _run():
    # what reporting needs, held before the solution runs (it may rebind module attributes)
    first = sys.stdin.readline
    token = first().strip()
    plan = json.loads(sys.stdin.read())
    dumps, write, flush, leave = json.dumps, sys.__stdout__.write, sys.__stdout__.flush, os._exit
    real_stdout = sys.stdout
    builtins.exit = builtins.quit = sys.exit  # `-S` leaves them out

    def report(**result):
        write("\n" + token + dumps(result) + "\n")
        flush()

    def error(exc):
        text = str(exc)
        return (type(exc).__name__ + ": " + text)[:300] if text else type(exc).__name__

    try:
        setup = compile(plan["setup"], "setup", "exec")
        program = compile(plan["solution"], "solution.py", "exec")
    except BaseException as exc:
        report(ran=False, error=error(exc))
        leave(0)
    report(ran=True)
    if plan["kind"] != "stdio":
        space = {"__name__": "solution"}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(setup, space)
                exec(program, space)
        except BaseException as exc:
            report(test=None, error=error(exc))
            leave(0)
    for i, test in enumerate(plan["tests"]):
        try:
            if "input" in test:  # the program on this input, as its standard input
                with open("stdin.txt", "w", encoding="utf-8") as f:
                    f.write(test["input"])
                fd = os.open("stdin.txt", os.O_RDONLY)
                os.dup2(fd, 0)
                os.close(fd)
                sys.stdin = io.TextIOWrapper(io.FileIO(0, closefd=False), encoding="utf-8")
                captured = io.BytesIO()
                wrapper = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
                sys.stdout = wrapper
                space = {"__name__": "__main__"}
                try:
                    exec(setup, space)
                    exec(program, space)
                except SystemExit:
                    pass
                finally:
                    sys.stdout = real_stdout
                    with contextlib.suppress(Exception):
                        wrapper.flush()
                text = captured.getvalue()[:100000].decode("utf-8", "replace")
                report(test=i, output=text)
                continue
            with contextlib.redirect_stdout(io.StringIO()):
                if "code" in test:  # a snippet that must run without error
                    exec(compile(test["code"], "test", "exec"), space)
                    report(test=i, ok=True)
                    continue
                if "expr" in test:
                    value = eval(compile(test["expr"], "test", "eval"), space)
                else:  # a call of the entry with JSON arguments, one per line
                    args = [json.loads(line) for line in test["args"].splitlines()
                            if line.strip()]
                    entry = plan["entry"]
                    value = getattr(space["Solution"](), entry)(*args) \
                        if "Solution" in space else space[entry](*args)
            try:
                report(test=i, value=plain(value, lists="args" in test))
            except (TypeError, ValueError, RecursionError) as exc:
                report(test=i, error="the result is not a plain value: " + str(exc)[:200])
        except BaseException as exc:
            sys.stdout = real_stdout
            report(test=i, error=error(exc))
    leave(0)

'''

#: The harness, run as `python -I -S main.py` in the sandbox.
HARNESS = _PROGRAM + inspect.getsource(plain) + "\n_run()\n"
