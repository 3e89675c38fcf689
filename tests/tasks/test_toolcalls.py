"""The tool-call grader core: parsing every call syntax (toolcall_parsing), BFCL comparison
rules, feedback, bounds (toolcalls)."""

from __future__ import annotations

import time

import pytest

from clbench.tasks.tool_use.calls import check_calls, grade_calls, normalize_string, values_equal
from clbench.tasks.tool_use.parsing import MAX_CALLS, ToolCall, calls_start, parse_calls

WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "dict", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer"},
        "threshold": {"type": "float"},
    }, "required": ["city"]},
}
SCHEMAS = {"get_weather": WEATHER}
EXPECTED = [{"name": "get_weather", "arguments": {
    "city": ["Paris", "Paris, France"], "unit": ["C", ""], "days": [3], "threshold": [2.0, ""]}}]


def grade(completion: str, expected: list | None = None) -> tuple[bool, str | None]:
    return grade_calls(completion, expected or EXPECTED, SCHEMAS)


# --- the truth table -------------------------------------------------------------------------

@pytest.mark.parametrize("completion, correct, feedback", [
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C", "days": 3}}', True, None),
    # optional argument omitted; alternative allowed value; BFCL string normalisation
    ('{"name": "get_weather", "arguments": {"city": "paris,france", "days": 3}}', True, None),
    # int accepted where a float is declared
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "threshold": 2}}',
     True, None),
    ('{"name": "get_forecast", "arguments": {"city": "Paris", "days": 3}}', False,
     "Called `get_forecast` but expected `get_weather`."),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K", "days": 3}}', False,
     "Argument `unit` must be one of ['C', 'F'], got 'K'."),
    # a value of the enum, but not the one the request asks for
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "F", "days": 3}}', False,
     "Argument `unit` has a wrong value: 'F'."),
    ('{"name": "get_weather", "arguments": {"city": "London", "days": 3}}', False,
     "Argument `city` has a wrong value: 'London'."),
    ('{"name": "get_weather", "arguments": {"days": 3}}', False,
     "Missing required argument `city`."),
    # not required by the schema, but the request fixes it (no "" among its allowed values)
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', False,
     "Missing argument `days`: the request specifies it."),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "foo": 1}}', False,
     "Unexpected argument `foo`."),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}', False,
     "Argument `days` must be of type integer, got str '3'."),
    # bool is never an integer, float is never an integer
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": true}}', False,
     "Argument `days` must be of type integer, got bool True."),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3.0}}', False,
     "Argument `days` must be of type integer, got float 3.0."),
    ("No idea, sorry.", False, "No function call found."),
    ('{"name": "get_weather", "arguments": {"city": "Paris"', False, "No function call found."),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
     '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', False,
     "Expected exactly one function call, got 2."),
])
def test_truth_table(completion: str, correct: bool, feedback: str | None) -> None:
    assert grade(completion) == (correct, feedback)


@pytest.mark.parametrize("completion", [
    'get_weather(city="Paris", unit="C", days=3)',
    "[get_weather(city='Paris', days=3, threshold=2.0)]",
    'Thought: the user wants weather.\n```json\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}\n```',
    'Sure! Here is the call: {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    '{"function": {"name": "get_weather", '
    '"arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}}',
    'Thought: I need the weather.\nAction: get_weather\nAction Input: {"city": "Paris", "days": 3}',
    '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
])
def test_every_call_syntax_is_read(completion: str) -> None:
    assert grade(completion) == (True, None)


def test_python_syntax_never_evaluates_and_needs_keyword_arguments() -> None:
    assert grade('get_weather(city=__import__("os").getcwd(), days=3)') == (
        False, "No function call found.")
    assert grade('get_weather("Paris", days=3)') == (
        False, "Pass the arguments of `get_weather` by name; got 1 positional argument(s).")
    # JSON spellings inside Python syntax, negative numbers, nested literals
    calls = parse_calls("f(a=true, b=null, c=-2.5, d={'k': [1, (2, 3)]})")
    assert calls == [ToolCall("f", {"a": True, "b": None, "c": -2.5, "d": {"k": [1, [2, 3]]}},
                              0)]


def test_json_wins_over_prose_that_looks_like_a_call() -> None:
    text = 'I will use(a) the tool: {"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert [c.name for c in parse_calls(text)] == ["get_weather"]


def test_dotted_names_match_with_underscores_as_bfcl_allows() -> None:
    expected = [{"name": "math.factorial", "arguments": {"number": [5]}}]
    assert grade_calls('{"name": "math_factorial", "arguments": {"number": 5}}', expected) == (
        True, None)
    assert grade_calls("math.factorial(number=5)", expected) == (True, None)


# --- parallel calls: multiset match ----------------------------------------------------------

PARALLEL = [
    {"name": "play", "arguments": {"artist": ["Taylor Swift"], "minutes": [20]}},
    {"name": "play", "arguments": {"artist": ["Maroon 5"], "minutes": [15]}},
]


def test_parallel_calls_match_in_any_order() -> None:
    in_order = ('[{"name": "play", "arguments": {"artist": "Taylor Swift", "minutes": 20}}, '
                '{"name": "play", "arguments": {"artist": "Maroon 5", "minutes": 15}}]')
    reversed_ = 'play(artist="Maroon 5", minutes=15)\nplay(artist="taylor swift", minutes=20)'
    assert grade_calls(in_order, PARALLEL) == (True, None)
    assert grade_calls(reversed_, PARALLEL) == (True, None)


def test_parallel_needs_a_one_to_one_match() -> None:
    twice = ('[{"name": "play", "arguments": {"artist": "Maroon 5", "minutes": 15}}, '
             '{"name": "play", "arguments": {"artist": "Maroon 5", "minutes": 15}}]')
    ok, feedback = grade_calls(twice, PARALLEL)
    assert not ok
    assert feedback == ("Expected call 1 (`play`) is not matched: Argument `artist` has a wrong "
                        "value: 'Maroon 5'.")
    assert grade_calls('play(artist="Maroon 5", minutes=15)', PARALLEL) == (
        False, "Expected 2 function calls, got 1.")


def test_matching_backtracks_where_greedy_pairing_fails() -> None:
    # call 0 fits both expectations, call 1 only the first: a greedy matcher pairs wrongly.
    expected = [{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "f", "arguments": {"x": [2]}}]
    calls = [ToolCall("f", {"x": 2}), ToolCall("f", {"x": 1})]
    assert check_calls(calls, expected) == (True, None)


# --- value semantics -------------------------------------------------------------------------

def test_bfcl_string_normalisation() -> None:
    assert normalize_string("April 1, 2024") == normalize_string("april 1 2024") == "april12024"
    assert normalize_string("New-York_City") == "newyorkcity"


@pytest.mark.parametrize("value, allowed, equal", [
    (1, 1.0, True), (True, 1, False), (1, True, False), ([1, "A b"], [1, "ab"], True),
    ([1, 2], [2, 1], False), ({"k": "x"}, {"k": ["X", "y"]}, True),
    ({"k": "x"}, {"k": ["x"], "j": [1]}, False), ({"k": "x"}, {"k": ["x"], "j": ["", 1]}, True),
    ({"k": "x", "z": 1}, {"k": ["x"]}, False), (None, None, True), ("1", 1, False),
])
def test_values_equal(value: object, allowed: object, equal: bool) -> None:
    assert values_equal(value, allowed) is equal


def test_without_a_schema_types_come_from_allowed_values() -> None:
    expected = [{"name": "search", "arguments": {"query": ["volcanoes"], "limit": [""]}}]
    assert grade_calls('{"name": "search", "arguments": {"query": "Volcanoes"}}', expected) == (
        True, None)
    assert grade_calls('{"name": "search", "arguments": {"limit": ""}}', expected) == (
        False, "Missing required argument `query`.")


# --- answer start ----------------------------------------------------------------------------

def test_calls_start_is_the_call_not_the_thought() -> None:
    text = 'Thought: weather needed.\n{"name": "get_weather", "arguments": {}}'
    assert calls_start(text) == text.index("{")
    react = "Thought: look it up.\nAction: search\nAction Input: {}"
    assert calls_start(react) == react.index("Action:")
    assert calls_start("no call here") is None


# --- adversarial output: bounded time, no exception ------------------------------------------

ADVERSARIAL = {
    "100k plain": "x" * 100_000,
    "deep braces": "{" * 100_000,
    "deep brackets": "[" * 50_000 + "]" * 50_000,
    "deep parens": "f(" * 50_000,
    "deep python literal": "f(a=" + "[" * 5_000 + "]" * 5_000 + ")",
    "nested json just over the cap": '{"name": "f", "arguments": {"a": ' + "[" * 40 + "]" * 40
                                     + "}}",
    "unterminated strings": '{"a": "' * 20_000,
    "json bomb list": "[" + ",".join(['{"name": "f", "arguments": {}}'] * 5_000) + "]",
    "repeated calls": '{"name": "get_weather", "arguments": {"city": "Paris"}}' * 3_000,
    "huge int json": '{"name": "get_weather", "arguments": {"days": ' + "9" * 6_000 + "}}",
    "huge int python": "get_weather(days=" + "9" * 6_000 + ")",
    "huge float": '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1e999}}',
    "broken unicode": "\ud800\udfff\x00" * 30_000 + '{"name": "get_weather\ud800"}',
    "many react blocks": "Action: f\nAction Input: {\n" * 10_000,
    "many call-like words": "a(b) " * 20_000,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_output_is_graded_fast(name: str) -> None:
    start = time.perf_counter()
    ok, feedback = grade(ADVERSARIAL[name])
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{name} took {elapsed:.2f} s"
    assert not ok
    assert feedback is not None
    feedback.encode("utf-8")  # always printable/storable, whatever the completion held


def test_call_count_is_capped() -> None:
    ok, feedback = grade('{"name": "get_weather", "arguments": {"city": "Paris"}}' * 100)
    assert (ok, feedback) == (False,
                              f"Expected exactly one function call, got {MAX_CALLS} or more.")
