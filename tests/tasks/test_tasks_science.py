"""Offline science sources: the fact tables, determinism, split disjointness, references that grade
correct, and the free-form and multiple-choice grader truth tables."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter

import pytest
from where import REPO

from clbench.tasks.grading import warm_up_verifier
from clbench.tasks.science.chemistry import compounds, elements, formula_counts, molar_mass
from clbench.tasks.science.generated import (
    FAMILIES,
    MCQ,
    NO_ANSWER_FEEDBACK,
    NO_CHOICE_FEEDBACK,
    Facts,
    grade_choice,
)

# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def test_element_table_is_the_whole_periodic_table() -> None:
    table = elements()
    assert [e.number for e in table] == list(range(1, 119))
    assert len({e.symbol for e in table}) == 118
    by_symbol = {e.symbol: e for e in table}
    assert (by_symbol["Na"].name, by_symbol["Na"].number, by_symbol["Na"].group,
            by_symbol["Na"].period) == ("Sodium", 11, 1, 3)
    assert by_symbol["Fe"].molar_mass == pytest.approx(55.845)
    assert by_symbol["Tc"].molar_mass is None          # no stable isotope, no standard weight
    # Standard atomic weights grow with Z except for the classic inversions.
    inversions = {(e.symbol, f.symbol) for e, f in itertools.pairwise(table)
                  if e.molar_mass and f.molar_mass and f.molar_mass < e.molar_mass}
    assert inversions == {("Ar", "K"), ("Co", "Ni"), ("Te", "I"), ("Th", "Pa")}


@pytest.mark.parametrize("formula, counts", [
    ("H2O", {"H": 2, "O": 1}),
    ("Ca(OH)2", {"Ca": 1, "O": 2, "H": 2}),
    ("(NH4)2SO4", {"N": 2, "H": 8, "S": 1, "O": 4}),
    ("C2H5OH", {"C": 2, "H": 6, "O": 1}),
    ("CO(NH2)2", {"C": 1, "O": 1, "N": 2, "H": 4}),
])
def test_formula_counts(formula: str, counts: dict[str, int]) -> None:
    assert formula_counts(formula) == counts


@pytest.mark.parametrize("bad", ["H2O)", "(H2O", "h2o", "2H"])
def test_malformed_formulas_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        formula_counts(bad)


@pytest.mark.parametrize("formula, mass", [
    ("H2O", 18.015), ("CO2", 44.009), ("NaCl", 58.44), ("C6H12O6", 180.156),
    ("H2SO4", 98.072), ("CaCO3", 100.086),
])
def test_molar_masses_match_hand_computed_values(formula: str, mass: float) -> None:
    assert molar_mass(formula) == pytest.approx(mass, abs=0.002)


def test_every_compound_has_a_computable_mass() -> None:
    assert len(compounds()) >= 80
    assert all(molar_mass(f) > 0 for f, _ in compounds())


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------

FACT_CONFIGS = [{"families": [f]} for f in FAMILIES] + [{}]
CONFIG_IDS = [",".join(c.get("families", ["default"])) for c in FACT_CONFIGS]


@pytest.mark.parametrize("params", FACT_CONFIGS, ids=CONFIG_IDS)
def test_every_fact_reference_grades_correct(params: dict) -> None:
    src = Facts(params)
    size = 15 if params.get("families", [""])[0] == "group" else 20
    for ex in src.examples("eval", 0, size) + src.examples("train", 0, 60):
        assert src.grade(ex, ex.reference).correct, (ex.id, ex.reference)


@pytest.mark.parametrize("params", FACT_CONFIGS, ids=CONFIG_IDS)
def test_fact_splits_are_disjoint_and_deterministic(params: dict) -> None:
    src = Facts(params)
    size = 15 if params.get("families", [""])[0] == "group" else 20
    evals = src.examples("eval", 0, size)
    assert evals == Facts(params).examples("eval", 0, size)
    train = src.examples("train", 0, 60)
    assert not {e.id for e in evals} & {e.id for e in train}
    assert not {e.messages[-1]["content"] for e in evals} & {e.messages[-1]["content"]
                                                              for e in train}


def test_default_mix_has_room_for_hundreds_of_eval_items() -> None:
    src = Facts()
    evals = src.examples("eval", 1234, 300)
    assert len({e.id for e in evals}) == 300
    families = Counter(e.metadata["family"] for e in evals)
    assert set(families) == set(src.params.families)


def test_unknown_family_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown families \\['colour'\\]"):
        Facts({"families": ["symbol", "colour"]})


def test_prompt_has_a_worked_example_of_the_same_family() -> None:
    ex = Facts({"families": ["atomic_number"]}).examples("eval", 0, 1)[0]
    assert [m["role"] for m in ex.messages] == ["user", "assistant", "user"]
    assert ex.messages[0]["content"].startswith("What is the atomic number of")
    assert ex.messages[1]["content"].splitlines()[-1].startswith("Answer: ")
    assert ex.messages[-1]["content"].endswith("End with 'Answer: <answer>'.")


def _with_answer(family: str, value: str):
    """An item of `family` whose gold answer is `value` (the grader reads only the answer)."""
    src = Facts({"families": [family]})
    ex = src.examples("eval", 0, 1)[0]
    return src, dataclasses.replace(ex, answer={**ex.answer, "value": value})


@pytest.mark.parametrize("completion, correct", [
    ("Answer: Na", True),
    ("The symbol of sodium is Na.\nAnswer: Na.", True),
    ("<answer>Na</answer>", True),
    ("Answer: NA", False),            # symbols are case-sensitive
    ("Answer: na", False),
    ("Answer: N", False),             # a prefix of the symbol
    ("Answer: Nat", False),           # the symbol as a prefix
    ("Answer: Sodium", False),        # the element's name is not its symbol
    ("Answer: Ne", False),
])
def test_symbol_grader(completion: str, correct: bool) -> None:
    src, ex = _with_answer("symbol", "Na")
    assert src.grade(ex, completion).correct is correct


def test_numeric_grader_truth_table() -> None:
    src = Facts({"families": ["mass_from_moles"]})
    ex = src.examples("eval", 0, 1)[0]
    gold = float(ex.answer["value"])
    assert src.grade(ex, f"Answer: {gold}").correct
    assert src.grade(ex, f"Answer: {gold * 1.005:.2f} g").correct        # within 1%
    assert src.grade(ex, f"Answer: **{gold:.1f}** grams").correct
    assert not src.grade(ex, f"Answer: {gold * 1.05:.2f}").correct       # 5% off
    wrong = src.grade(ex, "Answer: 12345")
    assert wrong.feedback == "Your answer 12345 is wrong." and wrong.reward == 0.0
    missing = src.grade(ex, f"It weighs {gold} g.")
    assert missing.feedback == NO_ANSWER_FEEDBACK and not missing.correct


def test_scientific_notation_answers() -> None:
    src = Facts({"families": ["particles"]})
    ex = src.examples("eval", 0, 1)[0]
    mant, exp = ex.answer["value"].split("e")
    for written in (f"{mant} × 10^{exp}", f"{mant}e{exp}", f"{mant} x 10^{{{exp}}}",
                    f"{mant} * 10**{exp}"):
        assert src.grade(ex, f"Answer: {written}").correct, written
    assert not src.grade(ex, f"Answer: {mant} × 10^{int(exp) + 1}").correct


def test_unit_conversion_is_exact() -> None:
    src = Facts({"families": ["unit_conversion"]})
    for ex in src.examples("eval", 0, 30):
        gold = ex.answer["value"]
        assert src.grade(ex, f"Answer: {gold}").correct
        assert not src.grade(ex, f"Answer: {float(gold) * 1.001 + 0.001}").correct


@pytest.mark.parametrize("gold, other", [("Aluminium", "aluminum"), ("Caesium", "Cesium"),
                                         ("Sulfur", "sulphur")])
def test_element_names_accept_common_spellings(gold: str, other: str) -> None:
    src, ex = _with_answer("name", gold)
    for written in (gold, gold.upper(), other):
        assert src.grade(ex, f"Answer: {written}").correct, written
    assert not src.grade(ex, "Answer: Selenium").correct
    # the spellings are of the same element only: another element's alias is no answer
    _, nickel = _with_answer("name", "Nickel")
    assert not src.grade(nickel, f"Answer: {other}").correct


# ---------------------------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------------------------

def test_mcq_options_are_distinct_with_one_correct_letter() -> None:
    src = MCQ({"families": ["symbol", "atomic_number", "molar_mass", "name", "neutrons"]})
    items = src.examples("eval", 0, 100)
    for ex in items:
        lines = ex.messages[-1]["content"].splitlines()
        options = [ln[3:] for ln in lines if ln[:3] in ("A. ", "B. ", "C. ", "D. ")]
        assert len(options) == 4 and len(set(options)) == 4
        assert src.grade(ex, ex.reference).correct
    # The correct letter is spread over the options (no position bias to exploit).
    letters = Counter(ex.answer for ex in items)
    assert set(letters) == set("ABCD") and max(letters.values()) < 45


@pytest.mark.parametrize("completion, correct, feedback", [
    ("<answer>B</answer>", True, None),
    ("Answer: B", True, None),
    ("The right one is (B)", True, None),
    ("<answer>C</answer>", False, "Your answer C is wrong."),
    ("I do not know", False, NO_CHOICE_FEEDBACK),
    ("", False, NO_CHOICE_FEEDBACK),
])
def test_choice_grader_truth_table(completion: str, correct: bool, feedback: str | None) -> None:
    grade = grade_choice("B", completion)
    assert (grade.correct, grade.feedback) == (correct, feedback)


@pytest.mark.parametrize("completion", [
    "A B C D " * 25_000,
    "<answer>" * 30_000,
    "Answer: " * 20_000 + "\\boxed{" * 10_000,
    "\udcff\ud800" * 50_000,
    "Answer: 1e" + "9" * 50_000,
    "Answer: " + "9" * 100_000,
])
def test_science_graders_are_bounded(completion: str) -> None:
    warm_up_verifier()
    for src in (Facts(), MCQ()):
        ex = src.examples("eval", 0, 1)[0]
        start = time.perf_counter()
        grade = src.grade(ex, completion)
        assert time.perf_counter() - start < 1.0
        assert not grade.correct


# ---------------------------------------------------------------------------------------------
# The shipped suites (math, science and tool-use columns alike)
# ---------------------------------------------------------------------------------------------




@pytest.mark.parametrize("suite_file", ["smoke.yaml", "starter.yaml", "paper.yaml"])
def test_shipped_suite_validates_with_its_plugins(suite_file: str) -> None:
    from clbench.plugins.runspec import validate_suite_plugins
    from clbench.spec.suites import load_suite

    path = REPO / "suites" / suite_file
    suite = load_suite(path)
    validate_suite_plugins(suite, path)
    assert suite.name == suite_file.removesuffix(".yaml")


@pytest.mark.parametrize("suite_file", ["smoke.yaml", "starter.yaml"])
def test_offline_suite_columns_can_draw_their_items(suite_file: str) -> None:
    """Every column draws its train and eval sizes without running out of distinct items."""
    from clbench.plugins.registry import build_task
    from clbench.spec.suites import load_suite

    suite = load_suite(REPO / "suites" / suite_file)
    for stage in suite.stages:
        task = build_task(stage.task)
        train = task.examples("train", stage.task.seed, stage.task.train_size)
        evals = task.examples("eval", stage.task.seed,
                              stage.task.eval_size or suite.protocol.eval_size)
        assert not {e.id for e in train} & {e.id for e in evals}
    for probe in suite.probes:
        if probe.task is not None:
            size = probe.task.eval_size or suite.protocol.eval_size
            assert len(build_task(probe.task).examples("eval", probe.task.seed, size)) == size
