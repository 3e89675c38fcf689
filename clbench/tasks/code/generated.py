"""`code.generated`: small function-synthesis problems with unit tests, offline.

Each family is a kind of function described in words (a linear map, a filter, a count, a string
transform) with parameters drawn per item: `Write a Python function `triple_plus(x)` that
returns 3 times x plus 4.` The prompt shows one worked example (another item of the same family,
excluded from both splits) and one test of the function asked for; the grader runs the
completion's code block against four hidden tests in the sandbox
(:mod:`clbench.tasks.code.grading`). Families not in a training mix are the distribution-shifted
probes: the default mix is `lists` (functions of a list: 0.37 greedy accuracy of the embedded
model, inside the band where training has a signal and room), and `basic` (functions of a
number or a string: 0.60) is held out (docs/tasks.md, calibration).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, field_validator

from clbench.tasks.base import (
    Example,
    Grade,
    Split,
    TaskParams,
    TaskSource,
    default_answer_start,
    draw_distinct,
    one_shot,
    seeded_rng,
)
from clbench.tasks.code.grading import CodeTests, code_start, grade_code

CODE_INSTRUCTION = "Answer with the function in a ```python code block."


@dataclass(frozen=True)
class Function:
    """A generated function: its name and parameter, what it does in words, its body, and the
    inputs it is tested on (the first is shown in the prompt)."""

    family: str
    name: str
    parameter: str
    words: str
    body: str
    compute: Callable[[Any], Any]
    inputs: tuple[Any, ...]

    @property
    def key(self) -> str:
        """What the function does: one function under two names is one item, in one split."""
        return f"{self.family}|{self.words}"

    @property
    def code(self) -> str:
        return f"def {self.name}({self.parameter}):\n    return {self.body}\n"

    def test(self, value: Any) -> str:
        return f"assert {self.name}({value!r}) == {self.compute(value)!r}"

    @property
    def question(self) -> str:
        return (f"Write a Python function `{self.name}({self.parameter})` that {self.words}. "
                f"For example: `{self.test(self.inputs[0])}`. {CODE_INSTRUCTION}")

    @property
    def reference(self) -> str:
        return f"```python\n{self.code}```"


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 40) -> tuple[int, ...]:
    return tuple(rng.randint(lo, hi) for _ in range(n))


def _lists(rng: random.Random, n: int) -> tuple[list[int], ...]:
    return tuple([rng.randint(-9, 30) for _ in range(rng.randint(2, 6))] for _ in range(n))


_WORDS = ("apple", "sky", "river", "code", "tree", "moon", "data", "stone", "light", "bird")


def _strings(rng: random.Random, n: int) -> tuple[str, ...]:
    return tuple(rng.choice(_WORDS) for _ in range(n))


def _linear(rng: random.Random) -> Function:
    a, b = rng.randint(2, 12), rng.randint(-20, 30)
    name = rng.choice(("scale_add", "affine", "times_plus", "grow"))
    then = f"plus {b}" if b >= 0 else f"minus {-b}"
    return Function("linear", name, "x", f"returns {a} times x {then}", f"{a} * x + {b}",
                    lambda x: a * x + b, _ints(rng, 5))


def _clamp(rng: random.Random) -> Function:
    lo = rng.randint(-20, 10)
    hi = lo + rng.randint(5, 25)
    name = rng.choice(("clamp", "limit", "bound"))
    return Function("clamp", name, "x", f"returns x limited to the range {lo} to {hi} (the "
                    f"nearest end when x is outside it)", f"max({lo}, min({hi}, x))",
                    lambda x: max(lo, min(hi, x)), _ints(rng, 5, lo - 15, hi + 15))


def _last_digits(rng: random.Random) -> Function:
    k = rng.randint(1, 4)
    name = rng.choice(("last_digits", "tail_digits", "low_digits"))
    digits = "the last digit" if k == 1 else f"the last {k} digits"
    return Function("last_digits", name, "n", f"returns the number formed by {digits} of the "
                    "non-negative integer n",
                    f"n % {10 ** k}", lambda n: n % 10 ** k,
                    tuple(rng.randint(0, 99999) for _ in range(5)))


def _repeat(rng: random.Random) -> Function:
    k = rng.randint(2, 5)
    sep = rng.choice(("-", " ", "+", "", ",", "/"))
    name = rng.choice(("repeat", "echo", "stutter"))
    joined = f'"{sep}".join([s] * {k})'
    return Function("repeat", name, "s", f"returns the string s repeated {k} times, joined by "
                    f"{sep!r}", joined, lambda s: sep.join([s] * k), _strings(rng, 5))


#: How a family's words compare: the symbol its reference code writes, the function it computes.
_COMPARISONS = {"greater than": (">", operator.gt), "less than": ("<", operator.lt),
                "equal to": ("==", operator.eq)}


def _count_where(rng: random.Random) -> Function:
    k = rng.randint(-30, 60)
    words, (op, holds) = rng.choice(list(_COMPARISONS.items()))
    name = rng.choice(("count_where", "how_many", "tally"))
    return Function("count_where", name, "nums", f"returns how many numbers in the list nums "
                    f"are {words} {k}", f"sum(1 for v in nums if v {op} {k})",
                    lambda xs: sum(1 for v in xs if holds(v, k)), _lists(rng, 5))


def _sum_multiples(rng: random.Random) -> Function:
    k = rng.randint(2, 12)
    keep = rng.choice((True, False))
    name = rng.choice(("sum_multiples", "add_selected", "total_of"))
    words = "that are multiples of" if keep else "that are not multiples of"
    test = "==" if keep else "!="
    return Function("sum_multiples", name, "nums", f"returns the sum of the numbers in the list "
                    f"nums {words} {k}", f"sum(v for v in nums if v % {k} {test} 0)",
                    lambda xs: sum(v for v in xs if (v % k == 0) == keep), _lists(rng, 5))


_LENGTHS = {"at least": (">=", operator.ge), "at most": ("<=", operator.le),
            "exactly": ("==", operator.eq)}


def _keep_words(rng: random.Random) -> Function:
    k = rng.randint(2, 7)
    words, (op, holds) = rng.choice(list(_LENGTHS.items()))
    name = rng.choice(("keep_words", "select_words", "filter_words"))
    return Function("keep_words", name, "words", f"returns the words of the list words that "
                    f"have {words} {k} letters, in their order",
                    f"[w for w in words if len(w) {op} {k}]",
                    lambda ws: [w for w in ws if holds(len(w), k)],
                    tuple(list(_strings(rng, rng.randint(2, 5))) for _ in range(5)))


def _scale_list(rng: random.Random) -> Function:
    a, b = rng.choice([v for v in range(-9, 10) if v not in (0, 1)]), rng.randint(-20, 20)
    name = rng.choice(("scale_all", "map_affine", "transform"))
    return Function("scale_list", name, "nums", f"returns a new list with each number of the "
                    f"list nums multiplied by {a} and "
                    f"{f'increased by {b}' if b >= 0 else f'decreased by {-b}'}",
                    f"[{a} * v + {b} for v in nums]", lambda xs: [a * v + b for v in xs],
                    _lists(rng, 5))


#: The families by mix: `basic` one-number and one-string functions, `lists` functions of lists.
FAMILIES: dict[str, Callable[[random.Random], Function]] = {
    "linear": _linear, "clamp": _clamp, "last_digits": _last_digits, "repeat": _repeat,
    "count_where": _count_where, "sum_multiples": _sum_multiples, "keep_words": _keep_words,
    "scale_list": _scale_list}
MIXES = {"basic": ("linear", "clamp", "last_digits", "repeat"),
         "lists": ("count_where", "sum_multiples", "keep_words", "scale_list")}


class GeneratedCodeParams(TaskParams):
    families: list[str] = Field(default_factory=lambda: list(MIXES["lists"]),
                                description="Families drawn from: any of "
                                f"{', '.join(FAMILIES)} (the default is the `lists` mix; "
                                f"{', '.join(MIXES['basic'])} are the held-out `basic` mix).")
    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="Share of the item "
                                 "space reserved for evaluation (assigned by a hash of the item).")

    @field_validator("families")
    @classmethod
    def _known(cls, families: list[str]) -> list[str]:
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or not families:
            raise ValueError(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} "
                             f"{', '.join(unknown) or '(none given)'}; choose from "
                             f"{', '.join(FAMILIES)}")
        return list(dict.fromkeys(families))


class GeneratedCode(TaskSource):
    name = "code.generated"
    description = ("Small Python functions described in words (linear maps, clamps, digits, "
                   "strings, list filters), graded by unit tests in a sandbox.")
    domain = "code"
    grades_in_parallel: ClassVar[bool] = True
    runs_code: ClassVar[bool] = True
    Params = GeneratedCodeParams
    params: GeneratedCodeParams

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        families = self.params.families
        demos = {f: FAMILIES[f](seeded_rng(self.name, f, "demo")) for f in families}
        rng = seeded_rng(self.name, self.params.draw_key(), split, seed)

        def make(r: random.Random) -> tuple[str, Function]:
            fn = FAMILIES[r.choice(families)](r)
            return fn.key, fn

        chosen = draw_distinct(make, split, size, rng, self.params.eval_fraction,
                               exclude=frozenset(d.key for d in demos.values()),
                               what=f"{self.name} functions")
        out = []
        for fn in chosen:
            demo = demos[fn.family]
            tests = [fn.test(v) for v in fn.inputs[1:]]
            out.append(Example(
                id=f"{self.name}:{fn.key}",
                messages=one_shot(None, demo.question, demo.reference, fn.question),
                reference=fn.reference,
                answer={"kind": "asserts", "tests": tests},
                metadata={"family": fn.family}))
        return out

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_code(completion, CodeTests.from_answer(example.answer))

    def answer_start(self, completion: str) -> int:
        start = code_start(completion)
        return start if start is not None else default_answer_start(completion)
