"""Truth tables of the shared answer extraction and comparison helpers, and their time bounds."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import pytest

from clbench.tasks.grading import (
    extract_answer_line,
    extract_boxed,
    extract_choice,
    extract_tag,
    math_equivalent,
    normalize_answer,
    parse_number,
    warm_up_verifier,
)


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed {x^{2}+1}", "x^{2}+1"),
    ("\\boxed{3", None),
    ("no box at all", None),
    ("}}}\\boxed{9}{{{", "9"),
])
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("reasoning\nAnswer: 37", "37"),
    ("Final answer: **Na**\n", "Na"),
    ("The answer is: 12 apples", "12 apples"),
    ("answer: 1\nsome more\nANSWER: 2", "2"),
    ("no marker here", None),
    ("Answer:", None),
])
def test_extract_answer_line(text: str, expected: str | None) -> None:
    assert extract_answer_line(text) == expected


def test_extract_tag_takes_last_pair() -> None:
    assert extract_tag("<answer>A</answer> then <answer> C </answer>") == "C"
    assert extract_tag("<answer>A") is None
    assert extract_tag("</answer><answer>") is None


@pytest.mark.parametrize("text, expected", [
    ("<answer>B</answer>", "B"),
    ("Answer: (C)", "C"),
    ("Answer: B) water", "B"),
    ("\\boxed{D}", "D"),
    ("I am fairly sure.\nThe answer is C", "C"),
    ("It is B or C, not sure", None),              # two options named: no commitment
    ("A gas forms when the acid reacts", None),   # "A" as an article is not a choice
    ("<answer>E</answer>", None),                 # not one of the options
    ("", None),
    ("Answer: banana", None),
])
def test_extract_choice(text: str, expected: str | None) -> None:
    assert extract_choice(text) == expected


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("-7", Fraction(-7)), ("1,000", Fraction(1000)), ("0.25", Fraction(1, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("-\\dfrac{1}{2}", Fraction(-1, 2)), ("6/8", Fraction(3, 4)),
    ("1.5e3", Fraction(1500)), ("1.2 \\times 10^{3}", Fraction(1200)), ("$5$", Fraction(5)),
    ("\\$12", Fraction(12)), ("3.", Fraction(3)),
    ("abc", None), ("1/0", None), ("1e999999999", None), ("9" * 1000, None), ("", None),
])
def test_parse_number(text: str, value: Fraction | None) -> None:
    assert parse_number(text) == value


def test_normalize_answer_strips_wrappers() -> None:
    assert normalize_answer("$\\text{ 12 }$.") == "12"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("90^\\circ") == "90"


@pytest.mark.parametrize("pred, gold, same", [
    ("42", "42", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1,000", "1000", True),
    ("41", "42", False),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("(x+1)^2", "x^2+2x+1", True),
    ("x+1", "x^2+2x+1", False),
    ("", "0", False),
    ("banana", "5", False),
])
def test_math_equivalent(pred: str, gold: str, same: bool) -> None:
    assert math_equivalent(pred, gold) is same


ADVERSARIAL = [
    "x" * 100_000,
    "{" * 100_000,
    "}" * 50_000 + "{" * 50_000,
    "\\boxed{" * 30_000,
    "\\boxed{" * 20_000 + "1" + "}" * 20_000,
    "\\boxed{" + "9" * 100_000 + "}",
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{10**10**10**10}",
    "\\boxed{99999999!}",
    "\\boxed{(9^9)^{(9^9)}}",
    "\\boxed{\\frac{" * 2000 + "}" * 4000,
    "Answer: " + "1e" + "9" * 5000,
    "\udcff\ud800 broken \x00 unicode \ufffd" * 5000,
    "<answer>" * 20_000 + "</answer>" * 20_000,
    '{"a": ' * 30_000 + "1" + "}" * 30_000,
    ("Answer: A B C D " * 10_000),
]


def _grade_all(text: str) -> None:
    boxed = extract_boxed(text)
    math_equivalent(boxed if boxed is not None else text[:300], "5")
    math_equivalent(text, "5")
    extract_choice(text)
    parse_number(text)
    extract_answer_line(text)


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_return_within_one_second(text: str) -> None:
    warm_up_verifier()  # the first call imports sympy's grammars; that is not grading time
    start = time.perf_counter()
    _grade_all(text)
    assert time.perf_counter() - start < 1.0


def test_verifier_works_outside_the_main_thread() -> None:
    warm_up_verifier()
    results: list[bool] = []
    worker = threading.Thread(target=lambda: results.append(math_equivalent("(x+1)^2",
                                                                            "x^2+2x+1")))
    worker.start()
    worker.join(timeout=10)
    assert results == [True]
