"""Tool-use task sources: determinism, split disjointness, references that grade correct, the
BFCL loader on the installed package's files, the ToolAlpaca adapter on a local fixture."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from where import FIXTURES

from clbench.errors import UserError
from clbench.tasks.tool_use import bfcl
from clbench.tasks.tool_use.bfcl import BFCLMultiple, BFCLParallel, BFCLSimple
from clbench.tasks.tool_use.generated import (
    GeneratedTools,
    GeneratedToolsUnseen,
    ToolUseError,
    draw_slot,
    load_families,
)
from clbench.tasks.tool_use.toolalpaca import ToolAlpaca, toolalpaca_schema

FIXTURES = FIXTURES / "toolalpaca"
TRAIN_FILE = str(FIXTURES / "train_sample.json")
EVAL_FILE = str(FIXTURES / "eval_sample.json")


def ids(examples: list) -> list[str]:
    return [e.id for e in examples]


# --- the generated family --------------------------------------------------------------------

def test_generated_is_deterministic_and_seed_dependent() -> None:
    a = GeneratedTools().examples("train", 3, 40)
    b = GeneratedTools().examples("train", 3, 40)
    assert [(e.id, e.messages, e.reference) for e in a] == [(e.id, e.messages, e.reference)
                                                            for e in b]
    assert ids(GeneratedTools().examples("train", 4, 40)) != ids(a)


def test_generated_splits_are_disjoint_calls() -> None:
    task = GeneratedTools()
    train = task.examples("train", 0, 1500)
    evals = task.examples("eval", 0, 300) + task.examples("eval", 1, 300)
    assert not set(e.reference for e in train) & set(e.reference for e in evals)
    assert not set(ids(train)) & set(ids(evals))


def test_generated_family_is_large_enough_to_train_on() -> None:
    train = GeneratedTools().examples("train", 0, 3000)
    assert len(set(ids(train))) == 3000
    assert len({e.messages[-1]["content"] for e in train}) == 3000
    functions = {e.metadata["function"] for e in train}
    assert len(functions) == 18  # every function of the six seen families appears


@pytest.mark.parametrize("source", [GeneratedTools, GeneratedToolsUnseen])
@pytest.mark.parametrize("params", [
    {}, {"n_functions": 1, "demo_same_function": 1.0, "optional_rate": 1.0},
    {"n_functions": 6, "demo_same_function": 0.0, "conversion_rate": 1.0, "optional_rate": 0.0},
])
def test_every_generated_reference_grades_correct(source: type, params: dict) -> None:
    task = source(params)
    for split, size in (("train", 300), ("eval", 100)):
        for ex in task.examples(split, 7, size):
            grade = task.grade(ex, ex.reference)
            assert grade.correct and grade.reward == 1.0, (ex.reference, grade.feedback)


def _other_value(value: object, spec: dict, allowed: list) -> object:
    """A value of the argument's type that the item does not allow: another member of its
    enum, a changed number, another string."""
    if isinstance(spec.get("enum"), list):
        others = [e for e in spec["enum"] if e not in allowed]
        assert others, f"every value of {spec['enum']} is allowed"  # a grader that cannot fail
        return others[0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    return f"{value} Smith" if value else "something"


@pytest.mark.parametrize("source", [GeneratedTools, GeneratedToolsUnseen])
def test_every_generated_item_refuses_a_wrong_call_with_the_right_feedback(source: type) -> None:
    """References grade correct (above); here each item's own call, changed in one place,
    must grade wrong, told why: another function, an argument left out, a wrong value."""
    task = source({"conversion_rate": 0.5, "optional_rate": 0.5})
    for ex in task.examples("eval", 7, 60):
        call = json.loads(ex.reference)
        (expected,) = ex.answer["calls"]
        schema = next(s for s in ex.answer["schemas"] if s["name"] == call["name"])
        props, required = schema["parameters"]["properties"], schema["parameters"]["required"]

        def grade(changed: dict, ex=ex) -> tuple[bool, str | None]:
            g = task.grade(ex, json.dumps(changed))
            return g.correct, g.feedback

        assert grade({**call, "name": "send_fax"}) == (
            False, f"Called `send_fax` but expected `{call['name']}`.")
        for name, value in call["arguments"].items():
            allowed = expected["arguments"][name]
            other = _other_value(value, props[name], allowed)
            correct, feedback = grade({**call, "arguments": {**call["arguments"], name: other}})
            assert not correct and feedback is not None and f"`{name}`" in feedback, feedback
            assert "has a wrong value" in feedback, feedback  # a valid value, the wrong one
            if name in required:
                left_out = {k: v for k, v in call["arguments"].items() if k != name}
                assert grade({**call, "arguments": left_out}) == (
                    False, f"Missing required argument `{name}`.")


def test_generated_prompt_shape_and_knobs() -> None:
    task = GeneratedTools({"n_functions": 4, "demo_same_function": 0.0})
    for ex in task.examples("eval", 0, 50):
        system, _demo_user, demo_call, _user = ex.messages
        assert [m["role"] for m in ex.messages] == ["system", "user", "assistant", "user"]
        listed = json.loads(system["content"].split("\n")[1])
        assert len(listed) == 4 and ex.metadata["function"] in {f["name"] for f in listed}
        demo_name = json.loads(demo_call["content"])["name"]
        assert demo_name != ex.metadata["function"] and demo_name in {f["name"] for f in listed}
        assert system["content"].endswith('{"name": ..., "arguments": {...}}.')
        assert json.loads(ex.reference)["name"] == ex.metadata["function"]
    same = GeneratedTools({"demo_same_function": 1.0}).examples("eval", 0, 30)
    assert all(e.metadata["demo_function"] == e.metadata["function"] for e in same)
    assert all(e.messages[2]["content"] != e.reference for e in same)


def test_generated_unseen_families_never_overlap_the_seen_ones() -> None:
    seen = {e.metadata["family"] for e in GeneratedTools().examples("train", 0, 300)}
    unseen = {e.metadata["family"] for e in GeneratedToolsUnseen().examples("eval", 0, 100)}
    assert seen == set(load_families()["seen_families"])
    assert unseen == {"health", "media"}


def test_conversions_phrase_values_the_model_must_translate() -> None:
    import random

    slots = load_families()["slots"]
    rng = random.Random(0)
    draws = [draw_slot(slots["meeting_minutes"], rng, True) for _ in range(200)]
    assert (90, "an hour and 30 minutes") in draws and (120, "2 hours") in draws
    value, text = draw_slot(slots["date"], random.Random(1), True)
    assert value.startswith("2025-") and not text.startswith("2025-")
    assert draw_slot(slots["date"], random.Random(1), False)[1] == draw_slot(
        slots["date"], random.Random(1), False)[0]
    assert draw_slot(slots["time"], random.Random(3), False)[0] == "10:15"
    assert draw_slot(slots["time"], random.Random(3), True)[1] == "10:15 am"
    rng = random.Random(5)
    assert [draw_slot(slots["time"], rng, True) for _ in range(3)] == [
        ("16:30", "4:30 pm"), ("18:30", "6:30 pm"), ("19:00", "7 pm")]


def test_generated_params_are_validated_with_clear_errors() -> None:
    with pytest.raises(Exception, match="needs n_functions >= 2"):
        GeneratedTools({"n_functions": 1, "demo_same_function": 0.5})
    with pytest.raises(ToolUseError, match="unknown tool families \\['cooking'\\]"):
        GeneratedTools({"families": ["cooking"]})
    with pytest.raises(ToolUseError, match="could only draw"):
        GeneratedTools({"families": ["weather"], "max_args": 1}).examples("train", 0, 500)


def test_answer_start_is_the_call() -> None:
    task = GeneratedTools()
    text = 'Thought: forecast for Paris.\n{"name": "get_weather_forecast", "arguments": {}}'
    assert task.answer_start(text) == text.index("{")
    assert task.answer_start("Thought: hmm\nno call") == len("Thought: hmm\n")


def test_entry_points_register_every_tool_use_source() -> None:
    names = {e.name: e.value for e in entry_points(group="clbench.tasks")}
    for cls in (GeneratedTools, GeneratedToolsUnseen, BFCLSimple, BFCLMultiple, BFCLParallel,
                ToolAlpaca):
        assert names[cls.name] == f"{cls.__module__}:{cls.__name__}"
        assert cls.domain == "tool_use"


# --- BFCL from the installed bfcl-eval package -----------------------------------------------

@pytest.mark.parametrize("source, total", [(BFCLSimple, 400), (BFCLMultiple, 200),
                                           (BFCLParallel, 200)])
def test_bfcl_reads_the_installed_files_and_every_reference_grades_correct(
        source: type, total: int) -> None:
    task = source()  # eval_fraction 1.0: every item is an eval item
    items = task.examples("eval", 0, total)
    assert len(set(ids(items))) == total
    for ex in items:
        grade = task.grade(ex, ex.reference)
        assert grade.correct, (ex.id, ex.reference, grade.feedback)
    with pytest.raises(ToolUseError, match=f"has only {total} eval items"):
        task.examples("eval", 0, total + 1)


def test_bfcl_known_item_and_its_semantics() -> None:
    task = BFCLSimple()
    ex = next(e for e in task.examples("eval", 0, 400) if e.id == "simple_python_0")
    assert "base of 10 units and height of 5" in ex.messages[-1]["content"]
    good = '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}'
    assert task.grade(ex, good).correct  # optional `unit` omitted
    assert task.grade(ex, 'calculate_triangle_area(base=10, height=5, unit="units")').correct
    wrong = task.grade(ex, '{"name": "calculate_triangle_area", "arguments": {"base": 5, '
                           '"height": 10}}')
    assert wrong.feedback == "Argument `base` has a wrong value: 5."


def test_bfcl_parallel_prompt_asks_for_a_list_and_grades_any_order() -> None:
    task = BFCLParallel()
    ex = next(e for e in task.examples("eval", 0, 200) if e.id == "parallel_0")
    assert "JSON list" in ex.messages[0]["content"]
    calls = json.loads(ex.reference)
    assert task.grade(ex, json.dumps(calls[::-1])).correct
    assert not task.grade(ex, json.dumps(calls[:1])).correct


def test_bfcl_splits_are_disjoint_with_a_train_share() -> None:
    task = BFCLSimple({"eval_fraction": 0.5})
    train, evals = task.examples("train", 0, 150), task.examples("eval", 0, 150)
    assert not set(ids(train)) & set(ids(evals))
    assert ids(task.examples("eval", 0, 150)) == ids(evals)


def test_bfcl_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    bfcl.load_bfcl.cache_clear()

    def missing(package: str) -> None:
        raise ModuleNotFoundError(f"No module named {package!r}")

    monkeypatch.setattr(bfcl.resources, "files", missing)
    try:
        with pytest.raises(UserError, match="pip install --no-deps bfcl-eval"):
            BFCLMultiple().examples("eval", 0, 5)
    finally:
        monkeypatch.undo()
        bfcl.load_bfcl.cache_clear()


# --- ToolAlpaca on a local fixture in its record format --------------------------------------

def test_toolalpaca_release_split_from_a_mapping_of_files() -> None:
    task = ToolAlpaca({"data_files": {"train": TRAIN_FILE, "eval": EVAL_FILE}})
    assert task.origin == "hub"
    train = task.examples("train", 0, 10)
    evals = task.examples("eval", 0, 10)
    # 4 train instances: one has no action at all and is skipped; getDetails is not a call
    assert len(train) == 3 and len(evals) == 2
    assert not set(ids(train)) & set(ids(evals))
    for ex in train + evals:
        assert task.grade(ex, ex.reference).correct, ex.reference
    two_pictures = next(e for e in train if e.metadata["n_calls"] == 2)
    assert [c["name"] for c in two_pictures.answer["calls"]] == ["getPetPicture"] * 2


def test_toolalpaca_grading_and_prompt() -> None:
    task = ToolAlpaca({"data_files": {"train": TRAIN_FILE, "eval": EVAL_FILE}})
    ex = next(e for e in task.examples("train", 0, 10) if "Lisbon" in e.messages[-1]["content"])
    system = ex.messages[0]["content"]
    assert "Action Input:" in system and "getLocalTime" in system
    # the golden answer leaves `format` empty: omitting it is right, as is giving it empty
    react = 'Thought: time in Lisbon.\nAction: getLocalTime\nAction Input: {"city": "lisbon"}'
    assert task.grade(ex, react).correct
    assert task.answer_start(react) == react.index("Action:")
    bad = task.grade(ex, 'Action: getLocalTime\nAction Input: {"city": "Porto"}')
    assert bad.feedback == "Argument `city` has a wrong value: 'Porto'."
    enum = task.grade(ex, 'Action: getLocalTime\nAction Input: {"city": "Lisbon", '
                          '"format": "36h"}')
    assert enum.feedback == "Argument `format` must be one of ['12h', '24h'], got '36h'."


def test_toolalpaca_single_file_is_split_by_hash() -> None:
    task = ToolAlpaca({"data_files": TRAIN_FILE, "eval_fraction": 0.5})
    train, evals = task.examples("train", 0, 10), task.examples("eval", 0, 10)
    assert len(train) + len(evals) == 3
    assert not set(ids(train)) & set(ids(evals))
    assert ids(task.examples("train", 0, 10)) == ids(train)


def test_toolalpaca_schema_from_natural_language_description() -> None:
    schema = toolalpaca_schema("getPetPicture", 'Get a picture.\nParameters: {"animal": '
                               '"Required. string. One of: [cat, dog]. The animal.", '
                               '"size": "integer. Pixels."}\nOutput: A URL.')
    props = schema["parameters"]["properties"]
    assert props["animal"]["enum"] == ["cat", "dog"] and props["size"]["type"] == "integer"
    assert schema["parameters"]["required"] == ["animal"]


def test_toolalpaca_unreachable_data_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        ToolAlpaca({"data_files": str(tmp_path / "missing.json")}).examples("train", 0, 2)
