"""Tool-call comparison with BFCL semantics: the grader core of every tool-use task.

`check_calls` follows the Berkeley Function-Calling Leaderboard's AST checker: every expected
argument maps to a list of allowed values, `""` in that list means the argument may be omitted,
an int is accepted where a float is declared, strings are compared after BFCL's normalisation
(case, spaces and `,./-_*^` ignored), and parallel calls match as a multiset (any order).
Verdicts come with feedback a verifier would give ("Missing required argument `city`.").
`grade_calls` parses a completion (:mod:`clbench.tasks.tool_use.parsing`) and checks it.
"""

from __future__ import annotations

import re
from typing import Any

from clbench.tasks.tool_use.parsing import MAX_CALLS, ToolCall, calls_start, parse_calls

__all__ = ["NO_CALL_FEEDBACK", "ToolCall", "calls_start", "check_calls", "compare_call",
           "grade_calls", "normalize_string", "parse_calls", "safe_feedback", "values_equal"]

#: The feedback on a completion without a readable call: a format error (`Grade.format_error`).
NO_CALL_FEEDBACK = "No function call found."

# BFCL type names (plus JSON Schema's) -> the Python types a parsed value may have.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "float": (float,), "number": (int, float),
    "boolean": (bool,), "array": (list,), "tuple": (list,), "dict": (dict,), "object": (dict,),
}


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
            enum = spec.get("enum")
            if isinstance(enum, list) and not any(values_equal(value, e) for e in enum):
                return (f"Argument `{param}` must be one of {_show(enum, 200)}, "
                        f"got {_show(value)}.")  # one of them, but the wrong one, is below
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
        return False, NO_CALL_FEEDBACK
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
