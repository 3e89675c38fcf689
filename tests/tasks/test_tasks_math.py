"""Offline math sources: determinism, split disjointness, references that grade correct, grader
truth tables and feedback."""

from __future__ import annotations

import re
import time

import pytest

from clbench.errors import UserError
from clbench.tasks.base import TaskSizeError
from clbench.tasks.grading import warm_up_verifier
from clbench.tasks.math.generated import (
    NO_BOXED_FEEDBACK,
    Arithmetic,
    LinearEquations,
    WordProblems,
    boxed_answer_start,
    grade_boxed,
)

SOURCES = [
    (Arithmetic, {}),
    (Arithmetic, {"digits": 3, "operands": 3, "operators": "+-*"}),
    (Arithmetic, {"digits": 1, "operands": 4, "operators": "+-"}),
    (WordProblems, {}),
    (WordProblems, {"steps": 3, "max_value": 50}),
    (LinearEquations, {}),
    (LinearEquations, {"form": "both_sides"}),
    (LinearEquations, {"form": "one_step", "max_coefficient": 20, "max_solution": 30}),
]
IDS = [f"{cls.name}-{i}" for i, (cls, _) in enumerate(SOURCES)]


@pytest.mark.parametrize("cls, params", SOURCES, ids=IDS)
def test_same_inputs_give_same_items(cls, params) -> None:
    a = cls(params).examples("train", 7, 20)
    b = cls(params).examples("train", 7, 20)
    assert a == b
    assert [e.id for e in cls(params).examples("train", 8, 20)] != [e.id for e in a]


@pytest.mark.parametrize("cls, params", SOURCES, ids=IDS)
def test_train_and_eval_never_share_an_item(cls, params) -> None:
    src = cls(params)
    train = src.examples("train", 0, 400)
    evals = [e for seed in (0, 1, 2) for e in src.examples("eval", seed, 100)]
    assert len({e.id for e in train}) == 400
    assert not {e.id for e in train} & {e.id for e in evals}
    assert not {e.messages[-1]["content"] for e in train} & {e.messages[-1]["content"]
                                                              for e in evals}


@pytest.mark.parametrize("cls, params", SOURCES, ids=IDS)
def test_every_reference_grades_correct(cls, params) -> None:
    src = cls(params)
    for ex in src.examples("train", 3, 300) + src.examples("eval", 3, 100):
        grade = src.grade(ex, ex.reference)
        assert grade.correct and grade.reward == 1.0, (ex.id, ex.reference)


@pytest.mark.parametrize("cls, params", SOURCES, ids=IDS)
def test_prompt_is_one_worked_example_then_the_question(cls, params) -> None:
    src = cls(params)
    ex = src.examples("eval", 0, 5)[0]
    roles = [m["role"] for m in ex.messages]
    assert roles == ["user", "assistant", "user"]
    assert "\\boxed{}" in ex.messages[-1]["content"]
    demo_answer = re.search(r"\\boxed\{(-?\d+)\}", ex.messages[1]["content"])
    assert demo_answer is not None
    # The worked example is never itself an item of either split.
    demo_question = ex.messages[0]["content"]
    items = src.examples("train", 0, 300) + src.examples("eval", 0, 100)
    assert demo_question not in {e.messages[-1]["content"] for e in items}


def test_arithmetic_respects_digits_operands_and_precedence() -> None:
    ex = Arithmetic({"digits": 3, "operands": 4, "operators": "*+"}).examples("eval", 0, 50)
    for e in ex:
        expr = re.search(r"What is (.*)\?", e.messages[-1]["content"]).group(1)
        numbers = re.findall(r"\d+", expr)
        assert len(numbers) == 4 and all(len(n) == 3 for n in numbers)
        python_value = eval(expr.replace("×", "*"))
        assert e.answer == str(python_value)


def test_linear_equation_answers_solve_the_equation() -> None:
    for e in LinearEquations({"form": "both_sides"}).examples("eval", 0, 50):
        eq = re.search(r"Solve for x: (.*?)\. Put", e.messages[-1]["content"]).group(1)
        left, right = eq.split(" = ")
        x = int(e.answer)

        def value(side: str, x: int = x) -> int:
            side = re.sub(r"(\d)x", r"\1*x", side).replace("-x", "-1*x")
            return eval(side, {"x": x})

        assert value(left) == value(right)


def _story_answer(story: str) -> int:
    """A word problem's answer read from its sentences alone (an oracle independent of the
    generator's own arithmetic)."""
    one_step = [(r"has (\d+) \w+ and buys (\d+) more", lambda a, b: a + b),
                (r"had (\d+) \w+ and gave (\d+) to a friend", lambda a, b: a - b),
                (r"Each bag holds (\d+) \w+\. How many \w+ are in (\d+) bags", lambda a, b: a * b),
                (r"shares (\d+) \w+ equally among (\d+) friends", lambda a, b: a // b)]
    for pattern, apply in one_step:
        if found := re.search(pattern, story):
            return apply(int(found.group(1)), int(found.group(2)))
    total = int(re.search(r"^\w+ has (\d+) ", story).group(1))
    for sentence in re.findall(r"Then [^.]*\.", story):
        n = re.search(r"(\d+)", sentence)
        if "buys" in sentence or "finds" in sentence:
            total += int(n.group(1))
        elif "gives" in sentence:
            total -= int(n.group(1))
        else:
            total *= {"doubles": 2, "triples": 3}[sentence.split()[-1].rstrip(".")]
    return total


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_word_problem_answers_follow_the_story(steps: int) -> None:
    items = WordProblems({"steps": steps}).examples("eval", 0, 60)
    for e in items:
        story = e.messages[-1]["content"]
        assert int(e.answer) == _story_answer(story), story
    forms = ("buys", "gave", "bag", "shares") if steps == 1 else \
        ("buys", "finds", "gives", "doubles", "triples")
    seen = {f for e in items for f in forms if f in e.messages[-1]["content"]}
    assert seen == set(forms)  # every form of story was read


def test_too_large_a_request_is_a_clear_user_error() -> None:
    src = Arithmetic({"digits": 1, "operands": 2})
    with pytest.raises(TaskSizeError) as info:
        src.examples("eval", 0, 500)
    assert isinstance(info.value, UserError)
    assert "only" in str(info.value) and "500 requested" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Grader truth table
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, correct, feedback", [
    ("12 + 30 = 42.\n\\boxed{42}", True, None),
    ("\\boxed{42.0}", True, None),
    ("\\boxed{\\frac{84}{2}}", True, None),
    ("$\\boxed{ 42 }$", True, None),
    ("12 + 30 = 41.\n\\boxed{41}", False, "Your answer 41 is wrong."),
    ("\\boxed{42} no wait \\boxed{43}", False, "Your answer 43 is wrong."),
    ("The answer is 42.", False, NO_BOXED_FEEDBACK),
    ("\\boxed{}", False, NO_BOXED_FEEDBACK),
    ("\\boxed{42", False, NO_BOXED_FEEDBACK),
    ("", False, NO_BOXED_FEEDBACK),
])
def test_boxed_grader_truth_table(completion: str, correct: bool, feedback: str | None) -> None:
    grade = grade_boxed("42", completion)
    assert grade.correct is correct
    assert grade.reward == (1.0 if correct else 0.0)
    assert grade.feedback == feedback


def test_feedback_does_not_leak_the_gold_answer_unless_asked() -> None:
    src = Arithmetic()
    ex = src.examples("eval", 0, 1)[0]
    wrong = str(int(ex.answer) + 1)
    assert ex.answer not in src.grade(ex, f"\\boxed{{{wrong}}}").feedback
    revealing = Arithmetic({"reveal_answer_in_feedback": True})
    ex2 = revealing.examples("eval", 0, 1)[0]
    fb = revealing.grade(ex2, f"\\boxed{{{int(ex2.answer) + 1}}}").feedback
    assert fb.endswith(f"The correct answer is {ex2.answer}.")


def test_long_wrong_answers_are_shortened_in_feedback() -> None:
    grade = grade_boxed("1", "\\boxed{" + "7" * 5000 + "}")
    assert not grade.correct and len(grade.feedback) < 100


@pytest.mark.parametrize("completion", [
    "\\boxed{" * 30_000 + "42" + "}" * 30_000,
    "x" * 100_000 + "\\boxed{42}",
    "\\boxed{9^{9^{9^{9^{9}}}}}",
    "\\boxed{" + "9" * 100_000 + "}",
    "\udcff" * 50_000 + "\\boxed{1}",
])
def test_grader_is_bounded_on_adversarial_completions(completion: str) -> None:
    warm_up_verifier()
    src = Arithmetic()
    ex = src.examples("eval", 0, 1)[0]
    start = time.perf_counter()
    grade = src.grade(ex, completion)
    assert time.perf_counter() - start < 1.0
    assert 0.0 <= grade.reward <= 1.0


@pytest.mark.parametrize("completion, start", [
    ("12 + 30 = 42.\n\\boxed{42}", len("12 + 30 = 42.\n")),
    ("\\boxed{42}", 0),
    ("<think>12 + 30</think>\\boxed{42}", len("<think>12 + 30</think>")),
    ("no box\nlast line", len("no box\n")),
])
def test_answer_part_is_the_line_with_the_final_box(completion: str, start: int) -> None:
    assert boxed_answer_start(completion) == start
    assert Arithmetic().answer_start(completion) == start


@pytest.mark.parametrize("source, params", [
    ("math.arithmetic", {"digits": 2}), ("math.word_problems", {}),
    ("science.facts", {"families": ["neutrons"]}), ("science.mcq", {}),
    ("tool_use.generated", {})])
def test_the_reasoning_format_writes_the_same_items_differently(source: str, params: dict) -> None:
    """`think` changes how an item is written (the example and the reference reason inside
    <think>...</think>, the answer after it, and the prompt opens the block of the response to
    write), never which items are drawn: a suite that adds it keeps its items, and every
    reference, and what the model writes of it after the opened block, earns reward 1."""
    from clbench.plugins.registry import build_task
    from clbench.spec.schema import TaskSpec
    from clbench.tasks.base import THINK_PREFIX, continuation, response_prefix

    plain = build_task(TaskSpec(source=source, params=params)).examples("train", 7, 12)
    think_task = build_task(TaskSpec(source=source, params={**params, "think": True}))
    think = think_task.examples("train", 7, 12)
    assert [e.id for e in think] == [e.id for e in plain]
    for p, t in zip(plain, think):
        assert "<think>" not in p.reference and t.reference.startswith("<think>\n")
        _working, answer = t.reference[len("<think>\n"):].split("\n</think>\n")
        assert p.reference.endswith(answer) and "</think>" not in answer
        assert t.messages[-1] == {"role": "assistant", "content": THINK_PREFIX}
        assert response_prefix(t.messages) == THINK_PREFIX and response_prefix(p.messages) == ""
        assert t.messages[-3]["role"] == "assistant" and "</think>\n" in t.messages[-3]["content"]
        assert t.messages[-2] == p.messages[-1]  # the question itself is unchanged
        assert think_task.grade(t, t.reference).reward == 1.0
        assert continuation(t) == t.reference[len(THINK_PREFIX):]
        assert think_task.grade(t, continuation(t)).reward == 1.0
        assert continuation(p) == p.reference
