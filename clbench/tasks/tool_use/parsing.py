"""Tool-call parsing: finding the function calls in a model completion.

`parse_calls` reads three forms:

* JSON: `{"name": ..., "arguments": {...}}` (also `"parameters"`, an OpenAI-style
  `{"function": {...}}` wrapper, `"arguments"` given as a JSON string), a list of such objects,
  or several objects one after another, possibly inside ```json fences or after free text;
* ReAct, as ToolAlpaca writes it: `Action: name` then `Action Input: {...}`;
* Python call syntax: `get_weather(city="Paris")` or `[f(a=1), g(b=2)]` (BFCL's format), read
  with :mod:`ast` and a literal-only converter: nothing is ever evaluated.

Everything is bounded on adversarial input: the completion and every candidate are cut to fixed
lengths, nesting is capped before `json`/`ast` see the text, and the number of parse attempts is
capped, so a 100k-character completion parses in milliseconds. Comparing the calls with what was
expected is :mod:`clbench.tasks.tool_use.calls`.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_COMPLETION_CHARS = 20_000  # tool calls are short; beyond this is runaway generation
MAX_CANDIDATE_CHARS = 8_000    # one call (JSON value or Python expression)
MAX_NESTING = 24               # brackets inside one call
MAX_ATTEMPTS = 48              # candidate start positions tried per syntax
MAX_CALLS = 16                 # calls read from one completion


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: function name, keyword arguments, where it starts in the completion."""

    name: str
    arguments: dict[str, Any]
    start: int = 0
    positional: tuple[Any, ...] = field(default=())  # Python-syntax positional arguments


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

_JSON_OPEN = re.compile(r"[\[{]")
_JSON_SPECIAL = re.compile(r'["\\\[\]{}]')
_PY_SPECIAL = re.compile(r"[\"'\\\[\](){}]")
_CLOSERS = {"{": "}", "[": "]", "(": ")"}
_PY_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)[ \t]*\(")
_REACT = re.compile(r"Action[ \t]*:[ \t]*[`\"']?([A-Za-z_][\w.\-]*)[`\"']?[ \t]*\r?\n"
                    r"\s*Action[ _]Input[ \t]*:[ \t]*")


def _match_end(text: str, start: int, python: bool) -> int | None:
    """Index just past the bracket closing `text[start]`, or None (unbalanced, too deep/long).

    Skips string literals: double-quoted for JSON, single- or double-quoted for Python. Jumps
    between special characters with a regex so long plain stretches cost C time, not Python time.
    """
    special = _PY_SPECIAL if python else _JSON_SPECIAL
    limit = min(len(text), start + MAX_CANDIDATE_CHARS)
    stack: list[str] = []
    quote: str | None = None
    pos = start
    while True:
        m = special.search(text, pos, limit)
        if m is None:
            return None
        ch = m.group()
        pos = m.end()
        if quote is not None:
            if ch == "\\":
                pos += 1  # the escaped character never closes anything
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
            if len(stack) > MAX_NESTING:
                return None
        elif ch in ")]}":
            if not stack or stack.pop() != ch:
                return None
            if not stack:
                return pos


def _loads(text: str) -> Any:
    """`json.loads` that returns None instead of raising (bad JSON, huge ints, deep nesting)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError):
        return None


def _call_from_obj(obj: Any, start: int) -> ToolCall | None:
    """A call from one JSON object of a recognised shape, else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" in obj["function"]:
        obj = obj["function"]  # OpenAI tool_calls entry
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        return None
    args: Any = {}
    for key in ("arguments", "parameters", "args"):
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # OpenAI encodes arguments as a JSON string
        args = _loads(args) if len(args) <= MAX_CANDIDATE_CHARS else None
    if not isinstance(args, dict):
        return None
    return ToolCall(name.strip(), args, start)


def _calls_from_json(value: Any, start: int) -> list[ToolCall]:
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    if isinstance(value, list):
        calls = [_call_from_obj(v, start) for v in value[:MAX_CALLS]]
        return [c for c in calls if c is not None] if value and all(calls) else []
    call = _call_from_obj(value, start)
    return [call] if call else []


def _parse_json_calls(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    pos = 0
    for _ in range(MAX_ATTEMPTS):
        m = _JSON_OPEN.search(text, pos)
        if m is None:
            break
        begin = m.start()
        end = _match_end(text, begin, python=False)
        found = _calls_from_json(_loads(text[begin:end]), begin) if end else []
        if found:
            calls.extend(found)
            if len(calls) >= MAX_CALLS:
                break
            pos = end  # type: ignore[assignment]
        else:
            pos = begin + 1  # look inside: a call may be nested in a non-call object
    return calls[:MAX_CALLS]


def _parse_react_calls(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for m in _REACT.finditer(text):
        if len(calls) >= MAX_CALLS:
            break
        begin = m.end()
        args: Any = None
        if begin < len(text) and text[begin] == "{":
            end = _match_end(text, begin, python=False)
            args = _loads(text[begin:end]) if end else None
        if isinstance(args, dict):
            calls.append(ToolCall(m.group(1), args, m.start()))
    return calls


_NAMED_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False,
                   "None": None}


class _NotLiteral(Exception):
    """A Python call argument that is not a plain literal (it is never evaluated)."""


def _literal(node: ast.AST, depth: int = 0) -> Any:
    """The value of a literal expression node; raises `_NotLiteral` for anything else."""
    if depth > MAX_NESTING:
        raise _NotLiteral
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, type(...))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]  # JSON spellings inside Python syntax
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, depth + 1)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
        raise _NotLiteral
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k, depth + 1) if k is not None else None
            if not isinstance(key, (str, int, float, bool)):
                raise _NotLiteral
            out[key] = _literal(v, depth + 1)
        return out
    raise _NotLiteral


def _dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _parse_python_calls(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    skip_until = 0
    for attempt, m in enumerate(_PY_CALL.finditer(text)):
        if attempt >= MAX_ATTEMPTS or len(calls) >= MAX_CALLS:
            break
        if m.start() < skip_until:
            continue  # inside a call already read
        end = _match_end(text, m.end() - 1, python=True)
        if end is None:
            continue
        try:
            tree = ast.parse(text[m.start():end], mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            continue
        node = tree.body
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None:
            continue
        try:
            positional = tuple(_literal(a) for a in node.args)
            if any(k.arg is None for k in node.keywords):
                raise _NotLiteral  # **kwargs
            kwargs = {k.arg: _literal(k.value) for k in node.keywords}
        except (_NotLiteral, RecursionError):
            skip_until = end  # prose or nested calls: not a call we can grade
            continue
        calls.append(ToolCall(name, kwargs, m.start(), positional))
        skip_until = end
    return calls


def parse_calls(completion: str) -> list[ToolCall]:
    """Every function call in `completion`, in order of appearance; [] when there is none.

    JSON calls win over ReAct blocks, which win over Python call syntax: the first syntax that
    yields a call decides, so that prose like "use(a)" next to a JSON call is never read.
    """
    text = completion[:MAX_COMPLETION_CHARS]
    for parser in (_parse_json_calls, _parse_react_calls, _parse_python_calls):
        calls = parser(text)
        if calls:
            return calls
    return []


def calls_start(completion: str) -> int | None:
    """Offset where the first call starts (the answer part of a tool-use completion)."""
    calls = parse_calls(completion)
    return calls[0].start if calls else None
