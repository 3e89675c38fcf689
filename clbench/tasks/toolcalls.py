"""Tool-call parsing and BFCL-style comparison: the grader core of every tool-use task.

Parsing (`parse_calls`) finds the function calls in a model completion, in any of three forms:

* JSON: `{"name": ..., "arguments": {...}}` (also `"parameters"`, an OpenAI-style
  `{"function": {...}}` wrapper, `"arguments"` given as a JSON string), a list of such objects,
  or several objects one after another, possibly inside ```json fences or after free text;
* ReAct, as ToolAlpaca writes it: `Action: name` then `Action Input: {...}`;
* Python call syntax: `get_weather(city="Paris")` or `[f(a=1), g(b=2)]` (BFCL's format), read
  with :mod:`ast` and a literal-only converter: nothing is ever evaluated.

Comparison (`check_calls`) follows the Berkeley Function-Calling Leaderboard's AST checker: every
expected argument maps to a list of allowed values, `""` in that list means the argument may be
omitted, an int is accepted where a float is declared, strings are compared after BFCL's
normalisation (case, spaces and `,./-_*^` ignored), and parallel calls match as a multiset (any
order). Verdicts come with feedback a verifier would give ("Missing required argument `city`.").

Everything is bounded on adversarial input: the completion and every candidate are cut to fixed
lengths, nesting is capped before `json`/`ast` see the text, and the number of parse attempts is
capped, so a 100k-character completion grades in milliseconds.
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

# BFCL type names (plus JSON Schema's) -> the Python types a parsed value may have.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "float": (float,), "number": (int, float),
    "boolean": (bool,), "array": (list,), "tuple": (list,), "dict": (dict,), "object": (dict,),
}


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


# ---------------------------------------------------------------------------------------------
# Comparison (BFCL semantics)
# ---------------------------------------------------------------------------------------------

_STRIP = re.compile(r"[ ,./\-_*^]")


def normalize_string(text: str) -> str:
    """BFCL's string normalisation: drop spaces and `,./-_*^`, lowercase, `'` -> `"`."""
    return _STRIP.sub("", text).lower().replace("'", '"')


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def values_equal(value: Any, allowed: Any) -> bool:
    """Does a given value equal one allowed value (BFCL's per-type rules)?

    A dict whose values are lists is read as a nested allowed-values structure (as in BFCL's
    possible answers): each key maps to its own list of allowed values, `""` meaning optional.
    """
    if isinstance(value, str) and isinstance(allowed, str):
        return normalize_string(value) == normalize_string(allowed)
    if isinstance(value, bool) or isinstance(allowed, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    if _is_number(value) and _is_number(allowed):
        return value == allowed
    if isinstance(value, list) and isinstance(allowed, list):
        return len(value) == len(allowed) and all(map(values_equal, value, allowed))
    if isinstance(value, dict) and isinstance(allowed, dict):
        return _dict_matches(value, allowed)
    return type(value) is type(allowed) and value == allowed


def _dict_matches(value: dict, allowed: dict) -> bool:
    for key, v in value.items():
        if key not in allowed:
            return False
        options = allowed[key] if isinstance(allowed[key], list) else [allowed[key]]
        if not any(values_equal(v, o) for o in options):
            return False
    for key, options in allowed.items():
        if key not in value and not (isinstance(options, list) and "" in options):
            return False
    return True


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(t: str) -> str:
    return {"dict": "object", "tuple": "array"}.get(t, t)


def _coerce(value: Any, declared: str | None, items: str | None) -> Any:
    """BFCL's one coercion: an int where a float is declared (also inside arrays)."""
    if declared in ("float", "number") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if declared in ("array", "tuple") and isinstance(value, list) and items == "float":
        return [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    return value


def _type_error(param: str, value: Any, spec: dict, allowed: list) -> str | None:
    declared = spec.get("type")
    types = _TYPES.get(declared or "")
    if types is None:
        return None
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return None  # (bool is an int subclass, but never an acceptable integer)
    # BFCL accepts a value of the type the possible answers use (e.g. a variable name string).
    sample = next((a for a in allowed if a != ""), None)
    if sample is not None and type(value) is type(sample):
        return None
    return (f"Argument `{param}` must be of type {_type_name(declared)}, got "
            f"{type(value).__name__} {_show(value)}.")


def compare_call(call: ToolCall, name: str, allowed: dict[str, list[Any]],
                 schema: dict | None = None) -> str | None:
    """None when `call` is a correct call of `name`; else the verifier's complaint.

    `allowed` maps every argument the request determines to its allowed values (`""` among them:
    may be omitted). `schema` is the function's declaration (`parameters.properties`,
    `parameters.required`); without one, types come from the allowed values.
    """
    if call.name != name and call.name.replace(".", "_") != name.replace(".", "_"):
        return f"Called `{_clip(call.name)}` but expected `{name}`."
    if call.positional:
        return (f"Pass the arguments of `{name}` by name; got {len(call.positional)} "
                "positional argument(s).")
    params = (schema or {}).get("parameters", {}) or {}
    props: dict = params.get("properties", {}) or {}
    required = params.get("required")
    if required is None:
        required = [p for p, opts in allowed.items() if "" not in opts]
    args = call.arguments
    for param in required:
        if param not in args:
            return f"Missing required argument `{param}`."
    for param, value in args.items():
        if param not in allowed or (props and param not in props):
            return f"Unexpected argument `{_clip(str(param))}`."
        spec = props.get(param, {}) if isinstance(props.get(param), dict) else {}
        items = (spec.get("items") or {}).get("type") if isinstance(spec.get("items"), dict) \
            else None
        value = _coerce(value, spec.get("type"), items)
        problem = _type_error(param, value, spec, allowed[param])
        if problem:
            return problem
        if not any(values_equal(value, a) for a in allowed[param]):
            if isinstance(spec.get("enum"), list):
                return (f"Argument `{param}` must be one of {_show(spec['enum'], 200)}, "
                        f"got {_show(value)}.")
            return f"Argument `{param}` has a wrong value: {_show(value)}."
    for param, options in allowed.items():
        if param not in args and "" not in options:
            return f"Missing argument `{param}`: the request specifies it."
    return None


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _perfect_matching(ok: list[list[bool]]) -> list[int] | None:
    """Kuhn's augmenting paths: expected i -> call j with ok[i][j], all distinct, or None."""
    n_calls = len(ok[0]) if ok else 0
    owner = [-1] * n_calls

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(n_calls):
            if ok[i][j] and not seen[j]:
                seen[j] = True
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(ok)):
        if not augment(i, [False] * n_calls):
            return None
    assignment = [-1] * len(ok)
    for j, i in enumerate(owner):
        if i >= 0:
            assignment[i] = j
    return assignment


def check_calls(calls: list[ToolCall], expected: list[dict[str, Any]],
                schemas: dict[str, dict] | None = None) -> tuple[bool, str | None]:
    """Compare parsed calls with the expected ones: (correct, feedback).

    `expected` is a list of `{"name": ..., "arguments": {param: [allowed values]}}`; with more
    than one entry the calls must match them one to one, in any order (a multiset match).
    """
    schemas = schemas or {}
    if not calls:
        return False, "No function call found."
    if len(calls) != len(expected):
        got = f"{len(calls)} or more" if len(calls) >= MAX_CALLS else str(len(calls))
        if len(expected) == 1:
            return False, f"Expected exactly one function call, got {got}."
        return False, f"Expected {len(expected)} function calls, got {got}."
    verdicts = [[compare_call(c, e["name"], e["arguments"], schemas.get(e["name"]))
                 for c in calls] for e in expected]
    if len(expected) == 1:
        problem = verdicts[0][0]
        return problem is None, problem
    if _perfect_matching([[v is None for v in row] for row in verdicts]) is not None:
        return True, None
    # Explain the first expected call that nothing matches, against its most similar call.
    for i, exp in enumerate(expected):
        row = verdicts[i]
        if all(v is not None for v in row):
            same_name = [v for v in row if v is not None and not v.startswith("Called `")]
            reason = same_name[0] if same_name else f"no call of `{exp['name']}`."
            return False, f"Expected call {i + 1} (`{exp['name']}`) is not matched: {reason}"
    return False, "Each expected call is matched, but not one to one: a call is repeated."


def safe_feedback(text: str | None) -> str | None:
    """Feedback that encodes as UTF-8 whatever the completion contained (lone surrogates)."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def grade_calls(completion: str, expected: list[dict[str, Any]],
                schemas: dict[str, dict] | None = None) -> tuple[bool, str | None]:
    """Parse `completion` and check its calls; the one entry point the task sources use."""
    correct, feedback = check_calls(parse_calls(completion), expected, schemas)
    return correct, safe_feedback(feedback)


def calls_start(completion: str) -> int | None:
    """Offset where the first call starts (the answer part of a tool-use completion)."""
    calls = parse_calls(completion)
    return calls[0].start if calls else None
