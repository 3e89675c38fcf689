"""Math task sources: offline procedural families graded on `\\boxed{}`, and the boxed grader.

Offline families (exact integer answers, difficulty set by parameters):
- `math.arithmetic`: expressions with a chosen number of operands, digits and operators;
- `math.word_problems`: one- or multi-step stories over everyday quantities;
- `math.linear_equations`: solve for x, from one-step to unknowns on both sides.
Each prompt holds one worked example exchange (small models follow the format only then), drawn
from the same family and excluded from both splits. Distribution-shifted variants for OOD probes
are other parameters of the same families (more digits, more steps, another family); see
docs/tasks.md.

The grader (:func:`grade_boxed`, :func:`boxed_answer_start`) is task files' `boxed_math` grader
too (:mod:`clbench.tasks.declared`), the shipped hub math tasks' among them.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from clbench.tasks.base import (
    THINK_CLOSE,
    Example,
    Grade,
    Split,
    TaskParams,
    TaskSource,
    default_answer_start,
    draw_distinct,
    one_shot,
    reasoned,
    seeded_rng,
    think_field_description,
)
from clbench.tasks.grading import extract_boxed, math_equivalent, quote

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
NO_BOXED_FEEDBACK = "No final answer in \\boxed{} found."


def grade_boxed(gold: str, completion: str, reveal: bool = False) -> Grade:
    """Binary reward: the last `\\boxed{}` equals `gold` exactly or by math_verify."""
    pred = extract_boxed(completion)
    if pred is None or not pred.strip():
        return Grade(0.0, False, NO_BOXED_FEEDBACK, format_error=True)
    if math_equivalent(pred, str(gold)):
        return Grade(1.0, True, None)
    feedback = f"Your answer {quote(pred)} is wrong."
    if reveal:
        feedback += f" The correct answer is {gold}."
    return Grade(0.0, False, feedback)


def boxed_answer_start(completion: str) -> int:
    """Answer part of a math response: after `</think>`, else the line holding the last box."""
    if THINK_CLOSE in completion:
        return default_answer_start(completion)
    box = completion.rfind("\\boxed")
    if box < 0:
        return default_answer_start(completion)
    return completion.rfind("\n", 0, box) + 1


@dataclass(frozen=True)
class Problem:
    """A generated problem: canonical key, question text, worked solution lines, answer."""

    key: str
    question: str
    steps: tuple[str, ...]
    answer: int

    @property
    def reference(self) -> str:
        return self.response(think=False)

    def response(self, think: bool) -> str:
        """The worked solution: its steps, then the boxed answer (steps inside the reasoning
        block with `think`)."""
        return reasoned("\n".join(self.steps), f"\\boxed{{{self.answer}}}", think)


class ProceduralParams(TaskParams):
    """Options every offline math family shares."""

    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="Share of the item "
                                 "space reserved for evaluation (assigned by a hash of the item).")
    reveal_answer_in_feedback: bool = Field(default=False, description="Let the grader's "
                                            "feedback state the gold answer.")
    think: bool = Field(default=False, description=think_field_description())


class ProceduralMath(TaskSource):
    """Shared machinery: seeded generation, split by item hash, a worked example, boxed grading."""

    domain = "math"
    params: Any

    @abstractmethod
    def generate(self, rng: random.Random) -> Problem:
        """One random problem of this family under `self.params`."""

    def demo(self) -> Problem:
        """The worked example shown before every question (same for all items)."""
        return self.generate(seeded_rng(self.name, self.params.draw_key(), "demo"))

    def prompt(self, problem: Problem) -> str:
        return f"{problem.question} {BOXED_INSTRUCTION}"

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        demo = self.demo()
        rng = seeded_rng(self.name, self.params.draw_key(), split, seed)

        def make(r: random.Random) -> tuple[str, Problem]:
            p = self.generate(r)
            return p.key, p

        problems = draw_distinct(make, split, size, rng, self.params.eval_fraction,
                                 exclude=frozenset([demo.key]), what=f"{self.name} problems")
        out = []
        for p in problems:
            think = self.params.think
            messages = one_shot(None, self.prompt(demo), demo.response(think), self.prompt(p),
                                think)
            out.append(Example(id=f"{self.name}:{p.key}", messages=messages,
                               reference=p.response(think), answer=str(p.answer),
                               metadata={"family": self.name, "key": p.key}))
        return out

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_boxed(example.answer, completion, self.params.reveal_answer_in_feedback)

    def answer_start(self, completion: str) -> int:
        return boxed_answer_start(completion)


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------

class ArithmeticParams(ProceduralParams):
    digits: int = Field(default=2, ge=1, le=12, description="Digits of every operand.")
    operands: int = Field(default=2, ge=2, le=6, description="Number of operands.")
    operators: str = Field(default="+", pattern=r"^[+\-*]+$", description="Operators drawn "
                           "from, e.g. `+`, `+-`, `+-*` (usual precedence applies).")


class Arithmetic(ProceduralMath):
    name = "math.arithmetic"
    description = "Integer arithmetic expressions; difficulty by digits, operands and operators."
    Params = ArithmeticParams
    params: ArithmeticParams

    def generate(self, rng: random.Random) -> Problem:
        p = self.params
        lo, hi = 10 ** (p.digits - 1) if p.digits > 1 else 0, 10 ** p.digits - 1
        nums = [rng.randint(max(lo, 1), hi) for _ in range(p.operands)]
        ops = [rng.choice(p.operators) for _ in range(p.operands - 1)]
        expr = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:]))
        value = _evaluate(nums, ops)
        shown = expr.replace("*", "×")
        return Problem(key=expr.replace(" ", ""), question=f"What is {shown}?",
                       steps=(f"{shown} = {value}.",), answer=value)


def _evaluate(nums: list[int], ops: list[str]) -> int:
    """Value of `n0 o0 n1 o1 ...` with `*` binding tighter than `+`/`-`."""
    terms, signs = [nums[0]], [1]
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


# ---------------------------------------------------------------------------------------------
# Word problems
# ---------------------------------------------------------------------------------------------

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "George", "Hana", "Ivan", "Julia",
          "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_THINGS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells",
           "cards", "beads", "coins", "balloons"]


class WordProblemParams(ProceduralParams):
    steps: int = Field(default=1, ge=1, le=4, description="Number of arithmetic steps.")
    max_value: int = Field(default=30, ge=5, le=10_000, description="Largest number in a story.")


class WordProblems(ProceduralMath):
    name = "math.word_problems"
    description = "Everyday stories needing one to four arithmetic steps."
    Params = WordProblemParams
    params: WordProblemParams

    def generate(self, rng: random.Random) -> Problem:
        p = self.params
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        if p.steps == 1:
            return self._one_step(rng, name, thing)
        total = rng.randint(2, p.max_value)
        sentences = [f"{name} has {total} {thing}."]
        steps, key = [], [str(total)]
        for _ in range(p.steps):
            kind = rng.choice("+-*" if total <= p.max_value else "+-")
            if kind == "-" and total < 2:
                kind = "+"
            if kind == "+":
                n = rng.randint(1, p.max_value)
                sentences.append(rng.choice([f"Then {name} buys {n} more.",
                                             f"Then {name} finds {n} more."]))
                steps.append(f"{total} + {n} = {total + n}.")
                total += n
            elif kind == "-":
                n = rng.randint(1, total - 1)
                sentences.append(f"Then {name} gives {n} to a friend.")
                steps.append(f"{total} - {n} = {total - n}.")
                total -= n
            else:
                n = rng.choice([2, 3])
                verb = "doubles" if n == 2 else "triples"
                sentences.append(f"Then the number of {thing} {verb}.")
                steps.append(f"{total} × {n} = {total * n}.")
                total *= n
            key.append(f"{kind}{n}")
        sentences.append(f"How many {thing} does {name} have now?")
        return Problem(key="ws:" + ",".join(key), question=" ".join(sentences),
                       steps=tuple(steps), answer=total)

    def _one_step(self, rng: random.Random, name: str, thing: str) -> Problem:
        m = self.params.max_value
        kind = rng.choice("+-*/")
        a, b = rng.randint(2, m), rng.randint(2, m)
        if kind == "+":
            q = f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now?"
            return Problem(f"w1:{a}+{b}", q, (f"{a} + {b} = {a + b}.",), a + b)
        if kind == "-":
            a, b = max(a, b) + 1, min(a, b)
            q = f"{name} had {a} {thing} and gave {b} to a friend. How many {thing} are left?"
            return Problem(f"w1:{a}-{b}", q, (f"{a} - {b} = {a - b}.",), a - b)
        if kind == "*":
            q = f"Each bag holds {a} {thing}. How many {thing} are in {b} bags?"
            return Problem(f"w1:{a}*{b}", q, (f"{a} × {b} = {a * b}.",), a * b)
        q = (f"{name} shares {a * b} {thing} equally among {b} friends. How many {thing} does "
             "each friend get?")
        return Problem(f"w1:{a * b}/{b}", q, (f"{a * b} ÷ {b} = {a}.",), a)


# ---------------------------------------------------------------------------------------------
# Linear equations
# ---------------------------------------------------------------------------------------------

class LinearEquationParams(ProceduralParams):
    form: str = Field(default="two_step", pattern=r"^(one_step|two_step|both_sides)$",
                      description="`one_step` (x + b = c or ax = c), `two_step` (ax + b = c) or "
                      "`both_sides` (ax + b = cx + d).")
    max_coefficient: int = Field(default=9, ge=2, le=1000, description="Largest |coefficient|.")
    max_solution: int = Field(default=12, ge=1, le=10_000, description="Largest |x|.")


def _p(n: int) -> str:
    """A number as the right operand of a binary operator: negatives in parentheses."""
    return f"({n})" if n < 0 else str(n)


def _lin(a: int, b: int) -> str:
    """`ax + b` written the usual way (`x`, `-x`, `3x - 4`)."""
    ax = "x" if a == 1 else "-x" if a == -1 else f"{a}x"
    if b == 0:
        return ax
    return f"{ax} {'+' if b > 0 else '-'} {abs(b)}"


class LinearEquations(ProceduralMath):
    name = "math.linear_equations"
    description = "Solve a linear equation in x with an integer solution."
    Params = LinearEquationParams
    params: LinearEquationParams

    def generate(self, rng: random.Random) -> Problem:
        p = self.params
        x = rng.randint(-p.max_solution, p.max_solution)
        coef = [c for c in range(-p.max_coefficient, p.max_coefficient + 1) if c not in (0,)]
        if p.form == "one_step":
            if rng.random() < 0.5:
                b = rng.choice([c for c in coef if c != 0])
                eq = f"x {'+' if b > 0 else '-'} {abs(b)} = {x + b}"
                steps = (f"x = {x + b} {'-' if b > 0 else '+'} {abs(b)} = {x}.",)
            else:
                a = rng.choice([c for c in coef if c not in (1, -1)])
                eq = f"{a}x = {a * x}"
                steps = (f"x = {a * x} ÷ {_p(a)} = {x}.",)
        elif p.form == "two_step":
            a = rng.choice([c for c in coef if c not in (1, -1)])
            b = rng.choice(coef)
            eq = f"{_lin(a, b)} = {a * x + b}"
            steps = (f"{a}x = {a * x + b} - {_p(b)} = {a * x}.", f"x = {a * x} ÷ {_p(a)} = {x}.")
        else:
            a, c = rng.sample([k for k in coef], 2)
            b = rng.choice(coef)
            d = a * x + b - c * x
            eq = f"{_lin(a, b)} = {_lin(c, d)}"
            steps = (f"({a} - {_p(c)})x = {d} - {_p(b)}, so {a - c}x = {d - b}.",
                     f"x = {d - b} ÷ {_p(a - c)} = {x}.")
        return Problem(key=f"eq:{eq}", question=f"Solve for x: {eq}.", steps=steps, answer=x)

    def prompt(self, problem: Problem) -> str:
        return f"{problem.question} Put the value of x in \\boxed{{}}."
