"""Science task sources: verifiable questions from the fact tables in the repo.

Offline (tables in `clbench/data/science/`, read by :mod:`clbench.tasks.science.chemistry`):
- `science.facts`: free-form short answers ending in `Answer: X`, from a mix of families: element
  lookups (symbol, name, atomic number, period, group), isotope neutron counts, computed molar
  masses, mole/mass stoichiometry, particle counts and unit conversions. Lookup families have at
  most 118 items each; the computed families give thousands, so eval sets of hundreds stay
  disjoint from training.
- `science.mcq`: the same facts as four-option multiple choice with plausible distractors (nearby
  atomic numbers, look-alike symbols, slipped molar masses), answered as `<answer>X</answer>`.
Families not in a training mix are the distribution-shifted probes (see docs/tasks.md).

The letter grader (:func:`grade_choice`) is task files' `choice` grader too
(:mod:`clbench.tasks.declared`), the shipped hub multiple-choice tasks' among them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from pydantic import Field, field_validator

from clbench.tasks.base import (
    Example,
    Grade,
    Split,
    TaskParams,
    TaskSource,
    draw_distinct,
    one_shot,
    reasoned,
    seeded_rng,
    think_field_description,
)
from clbench.tasks.grading import (
    extract_answer_line,
    extract_boxed,
    extract_choice,
    extract_tag,
    format_number,
    numbers_close,
    parse_number,
    quote,
)
from clbench.tasks.science.chemistry import (
    compounds,
    constants,
    elements,
    formula_counts,
    molar_mass,
    units,
)

ANSWER_INSTRUCTION = "End with 'Answer: <answer>'."
MCQ_INSTRUCTION = "Reply with the letter of the correct option as <answer>X</answer>."
NO_ANSWER_FEEDBACK = "No final answer found; end with 'Answer: <answer>'."
NO_CHOICE_FEEDBACK = "No option letter found; answer with <answer>X</answer>."
LETTERS = "ABCD"


# ---------------------------------------------------------------------------------------------
# Question families
# ---------------------------------------------------------------------------------------------

def _mass_breakdown(formula: str) -> str:
    by_symbol = {e.symbol: e for e in elements()}
    parts = [(f"{n} × {by_symbol[s].molar_mass}" if n > 1 else f"{by_symbol[s].molar_mass}")
             for s, n in formula_counts(formula).items()]
    return " + ".join(parts)


@dataclass(frozen=True)
class Fact:
    """A generated question: canonical key, question, worked line, gold answer and its kind."""

    key: str
    question: str
    working: str
    answer: str
    kind: str              # "symbol", "name", "number" (graded numerically)
    rel_tol: float = 0.0   # numeric answers: allowed relative error (0 = exact)


_AMOUNTS = [0.1, 0.2, 0.25, 0.5, 0.75, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 15, 20]
_VALUES = [0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.8, 1.2, 1.25, 1.5, 1.8, 2, 2.4, 2.5, 3, 3.2,
           3.5, 4, 4.5, 5, 6, 6.5, 7.5, 8, 9, 10, 12, 15, 18, 25, 30, 40, 45, 60, 75, 90, 120,
           150, 250, 300, 500, 600]


def _fam_symbol(r: random.Random) -> Fact:
    e = r.choice(elements())
    return Fact(f"symbol:{e.number}", f"What is the chemical symbol of {e.name.lower()}?",
                f"The symbol of {e.name.lower()} is {e.symbol}.", e.symbol, "symbol")


def _fam_name(r: random.Random) -> Fact:
    e = r.choice(elements())
    return Fact(f"name:{e.number}", f"Which element has the chemical symbol {e.symbol}?",
                f"{e.symbol} is the symbol of {e.name.lower()}.", e.name, "name")


def _fam_atomic_number(r: random.Random) -> Fact:
    e = r.choice(elements())
    return Fact(f"z:{e.number}", f"What is the atomic number of {e.name.lower()}?",
                f"{e.name} has {e.number} protons.", str(e.number), "number")


def _fam_period(r: random.Random) -> Fact:
    e = r.choice(elements())
    return Fact(f"period:{e.number}", f"In which period of the periodic table is "
                f"{e.name.lower()}?", f"{e.name} (Z = {e.number}) is in period {e.period}.",
                str(e.period), "number")


def _fam_group(r: random.Random) -> Fact:
    e = r.choice([e for e in elements() if e.group is not None])
    return Fact(f"group:{e.number}", f"In which group (1-18) of the periodic table is "
                f"{e.name.lower()}?", f"{e.name} is in group {e.group}.", str(e.group), "number")


def _fam_neutrons(r: random.Random) -> Fact:
    e = r.choice([e for e in elements() if e.molar_mass is not None and e.number > 1])
    a = round(e.molar_mass or 0) + r.randint(-1, 2)
    return Fact(f"neutrons:{e.number}-{a}", f"How many neutrons are in an atom of "
                f"{e.name.lower()}-{a}?", f"{e.name} has {e.number} protons, so {a} - "
                f"{e.number} = {a - e.number} neutrons.", str(a - e.number), "number")


def _fam_molar_mass(r: random.Random) -> Fact:
    formula, name = r.choice(compounds())
    m = molar_mass(formula)
    return Fact(f"mm:{formula}", f"What is the molar mass of {name} ({formula}) in g/mol?",
                f"{formula}: {_mass_breakdown(formula)} = {m:.2f} g/mol.", f"{m:.2f}", "number",
                0.01)


def _fam_mass_from_moles(r: random.Random) -> Fact:
    formula, name = r.choice(compounds())
    n, m = r.choice(_AMOUNTS), round(molar_mass(formula), 2)
    return Fact(f"mass:{formula}:{n}", f"What is the mass in grams of {format_number(n)} mol of "
                f"{name} ({formula})?", f"M({formula}) = {m:.2f} g/mol, so "
                f"{format_number(n)} × {m:.2f} = {n * m:.2f} g.", f"{n * m:.2f}", "number", 0.01)


def _fam_moles_from_mass(r: random.Random) -> Fact:
    formula, name = r.choice(compounds())
    n, m = r.choice(_AMOUNTS), round(molar_mass(formula), 2)
    grams = round(n * m, 1)
    return Fact(f"moles:{formula}:{n}", f"How many moles are in {format_number(grams)} g of "
                f"{name} ({formula})?", f"M({formula}) = {m:.2f} g/mol, so "
                f"{format_number(grams)} / {m:.2f} = {grams / m:.3f} mol.", f"{grams / m:.3f}",
                "number", 0.01)


def _fam_particles(r: random.Random) -> Fact:
    formula, name = r.choice(compounds())
    n = r.choice(_AMOUNTS)
    na = constants()["avogadro"]["value"]
    count = n * na
    mant, exp = f"{count:.3e}".split("e")
    shown = f"{mant} × 10^{int(exp)}"
    return Fact(f"particles:{formula}:{n}", f"How many molecules are in {format_number(n)} mol "
                f"of {name} ({formula})?", f"{format_number(n)} × 6.022 × 10^23 = {shown}.",
                f"{mant}e{int(exp)}", "number", 0.01)


def _exact_decimal(value: Fraction) -> str:
    """A terminating fraction as an exact plain decimal (unit factors are powers of ten)."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    places = 0
    while (value * 10 ** places).denominator != 1:
        places += 1
        if places > 40:
            raise ValueError(f"{value} has no short exact decimal form")
    digits = str((value * 10 ** places).numerator).rjust(places + 1, "0")
    text = digits if places == 0 else f"{digits[:-places]}.{digits[-places:]}"
    return sign + text


@lru_cache(maxsize=1)
def _unit_pairs() -> tuple[tuple[str, str, Fraction], ...]:
    """(from, to, factor) for units of one quantity: ratios within 10^6 both ways and exact
    decimal factors only (s -> h is 1/3600, which has no exact decimal answer)."""
    pairs = []
    for _quantity, table in sorted(units().items()):
        for src in sorted(table):
            for dst in sorted(table):
                factor = Fraction(str(table[src])) / Fraction(str(table[dst]))
                terminating = 10**12 % factor.denominator == 0
                if src != dst and terminating and Fraction(1, 10**6) <= factor <= 10**6:
                    pairs.append((src, dst, factor))
    return tuple(pairs)


def _fam_unit_conversion(r: random.Random) -> Fact:
    src, dst, factor = r.choice(_unit_pairs())
    value = Fraction(str(r.choice(_VALUES)))
    result = value * factor
    shown = _exact_decimal(value)
    return Fact(f"unit:{value}{src}>{dst}", f"Convert {shown} {src} to {dst}.",
                f"1 {src} = {_exact_decimal(factor)} {dst}, so {shown} {src} = "
                f"{_exact_decimal(result)} {dst}.", _exact_decimal(result), "number", 1e-6)


FAMILIES: dict[str, Callable[[random.Random], Fact]] = {
    "symbol": _fam_symbol, "name": _fam_name, "atomic_number": _fam_atomic_number,
    "period": _fam_period, "group": _fam_group, "neutrons": _fam_neutrons,
    "molar_mass": _fam_molar_mass, "mass_from_moles": _fam_mass_from_moles,
    "moles_from_mass": _fam_moles_from_mass, "particles": _fam_particles,
    "unit_conversion": _fam_unit_conversion,
}

# Spellings accepted for element names besides the table's (IUPAC) one.
_NAME_ALIASES = {"aluminium": {"aluminum"}, "caesium": {"cesium"}, "sulfur": {"sulphur"}}


def _check_families(v: list[str]) -> list[str]:
    unknown = [f for f in v if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if not v:
        raise ValueError("give at least one family")
    return v


class FactParams(TaskParams):
    families: list[str] = Field(
        default=["symbol", "atomic_number", "neutrons", "unit_conversion"],
        description=f"Question families to mix (uniformly): {', '.join(FAMILIES)}.")
    eval_fraction: float = Field(default=0.25, gt=0.0, lt=1.0, description="Share of each "
                                 "family's item space reserved for evaluation (by item hash).")
    reveal_answer_in_feedback: bool = Field(default=False, description="Let the grader's "
                                            "feedback state the gold answer.")
    think: bool = Field(default=False, description=think_field_description())

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        return _check_families(v)


class _FactSource(TaskSource):
    domain = "science"
    params: Any

    def _draw(self, split: Split, seed: int, size: int) -> tuple[list[Fact], dict[str, Fact]]:
        demos = {f: FAMILIES[f](seeded_rng(self.name, f, "demo")) for f in self.params.families}
        rng = seeded_rng(self.name, self.params.draw_key(), split, seed)

        def make(r: random.Random) -> tuple[str, tuple[str, Fact]]:
            family = r.choice(self.params.families)
            fact = FAMILIES[family](r)
            return fact.key, (family, fact)

        drawn = draw_distinct(make, split, size, rng, self.params.eval_fraction,
                              exclude=frozenset(d.key for d in demos.values()),
                              what=f"{self.name} questions")
        return drawn, demos


class Facts(_FactSource):
    name = "science.facts"
    description = "Free-form science questions from the repo's element/compound/unit tables."
    Params = FactParams
    params: FactParams

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        drawn, demos = self._draw(split, seed, size)
        out = []
        think = self.params.think
        for family, fact in drawn:
            demo = demos[family]
            messages = one_shot(None, f"{demo.question} {ANSWER_INSTRUCTION}",
                                _reference(demo, think), f"{fact.question} {ANSWER_INSTRUCTION}",
                                think)
            out.append(Example(id=f"{self.name}:{fact.key}", messages=messages,
                               reference=_reference(fact, think),
                               answer={"value": fact.answer, "kind": fact.kind,
                                       "rel_tol": fact.rel_tol},
                               metadata={"family": family, "key": fact.key}))
        return out

    def grade(self, example: Example, completion: str) -> Grade:
        gold = example.answer
        pred = extract_answer_line(completion) or extract_tag(completion) or \
            extract_boxed(completion)
        if pred is None:
            return Grade(0.0, False, NO_ANSWER_FEEDBACK, format_error=True)
        if _short_answer_matches(pred, gold["value"], gold["kind"], gold["rel_tol"]):
            return Grade(1.0, True, None)
        feedback = f"Your answer {quote(pred)} is wrong."
        if self.params.reveal_answer_in_feedback:
            feedback += f" The correct answer is {gold['value']}."
        return Grade(0.0, False, feedback)


def _reference(fact: Fact, think: bool = False) -> str:
    answer = fact.answer
    if fact.kind == "number" and "e" in answer:
        mant, exp = answer.split("e")
        answer = f"{mant} × 10^{exp}"
    return reasoned(fact.working, f"Answer: {answer}", think)


_LEADING_NUMBER = re.compile(
    r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+|\s*(?:×|x|\*|\\times)\s*10\s*"
    r"(?:\^|\*\*)\s*\{?[-+−]?\d+\}?)?")


def _short_answer_matches(pred: str, gold: str, kind: str, rel_tol: float) -> bool:
    text = pred.strip().strip("*_`'\".").strip()[:200]
    if kind == "symbol":
        return text.split(" ")[0].strip(".,;()") == gold
    if kind == "name":
        word = text.split(" ")[0].strip(".,;()").lower()
        return word == gold.lower() or word in _NAME_ALIASES.get(gold.lower(), set())
    m = _LEADING_NUMBER.match(text.replace("$", ""))
    if not m or not m.group().strip():
        return False
    value = parse_number(m.group().replace("**", "^").replace(" ", ""))
    gold_value = parse_number(gold)
    return value is not None and gold_value is not None and numbers_close(
        value, gold_value, rel_tol=rel_tol)


# ---------------------------------------------------------------------------------------------
# Multiple choice over the same facts
# ---------------------------------------------------------------------------------------------

class MCQParams(FactParams):
    families: list[str] = Field(default=["symbol", "atomic_number", "molar_mass"],
                                description="Families to mix: symbol, name, atomic_number, "
                                "period, neutrons, molar_mass, mass_from_moles.")


def _distractors(fact: Fact, r: random.Random) -> list[str]:
    """Three wrong options that look right: neighbours, look-alikes, slipped computations."""
    gold = fact.answer
    pool: list[str] = []
    if fact.kind == "symbol":
        same_letter = [e.symbol for e in elements() if e.symbol[0] == gold[0] and e.symbol != gold]
        pool = same_letter + [e.symbol for e in elements() if e.symbol != gold]
    elif fact.kind == "name":
        pool = [e.name for e in elements() if e.name != gold and e.name[0] == gold[0]] + \
               [e.name for e in elements() if e.name != gold]
    else:
        g = float(gold)
        if g == int(g) and fact.rel_tol == 0:
            pool = [str(int(g) + d) for d in (-2, -1, 1, 2, 10, -10) if int(g) + d > 0]
        else:
            pool = [f"{g * k:.2f}" for k in (0.5, 2, 1.5, 0.75, 1.25)]
    seen, out = {gold}, []
    head, tail = pool[:6], pool[6:]
    r.shuffle(head)
    for cand in head + tail:
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
        if len(out) == 3:
            break
    return out


class MCQ(_FactSource):
    name = "science.mcq"
    description = "Four-option multiple choice over the element/compound facts."
    Params = MCQParams
    params: MCQParams

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        drawn, demos = self._draw(split, seed, size)
        out = []
        think = self.params.think
        for family, fact in drawn:
            demo_q, demo_letter = _mcq_prompt(demos[family])
            question, letter = _mcq_prompt(fact)
            messages = one_shot(None, demo_q, reasoned(demos[family].working,
                                                       f"<answer>{demo_letter}</answer>", think),
                                question, think)
            out.append(Example(id=f"{self.name}:{fact.key}", messages=messages,
                               reference=reasoned(fact.working, f"<answer>{letter}</answer>",
                                                  think),
                               answer=letter, metadata={"family": family, "key": fact.key}))
        return out

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_choice(example.answer, completion, self.params.reveal_answer_in_feedback)


def _mcq_prompt(fact: Fact) -> tuple[str, str]:
    r = seeded_rng("mcq-options", fact.key)
    options = [fact.answer] + _distractors(fact, r)
    r.shuffle(options)
    letter = LETTERS[options.index(fact.answer)]
    lines = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return f"{fact.question}\n{lines}\n{MCQ_INSTRUCTION}", letter


def grade_choice(gold: str, completion: str, reveal: bool = False,
                 letters: str = LETTERS) -> Grade:
    """Binary reward for a multiple-choice answer letter."""
    choice = extract_choice(completion, letters)
    if choice is None:
        return Grade(0.0, False, NO_CHOICE_FEEDBACK, format_error=True)
    if choice == gold:
        return Grade(1.0, True, None)
    feedback = f"Your answer {choice} is wrong."
    if reveal:
        feedback += f" The correct answer is {gold}."
    return Grade(0.0, False, feedback)
