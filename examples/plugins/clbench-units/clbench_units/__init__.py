"""Unit conversion: "Convert 3.5 km to m." answered with a number on an `Answer:` line.

Items are drawn from a generator of (quantity, unit, target unit) triples of the chosen kinds;
each item's split follows from its own key, so training and evaluation items never meet. The
grader reads the last `Answer:` line and accepts the exact value (a relative error of 1e-6 for
rounding), tells a completion without such a line that its format is wrong, and otherwise what
the right value was not.
"""

from __future__ import annotations

import random
from decimal import Decimal
from typing import ClassVar, Literal

from pydantic import Field

from clbench.api import (
    Example,
    Grade,
    Split,
    TaskParams,
    TaskSource,
    draw_distinct,
    extract_answer_line,
    one_shot,
    parse_number,
    seeded_rng,
)

#: Units of each kind and how many of the kind's base unit one of them is.
UNITS: dict[str, dict[str, Decimal]] = {
    "length": {"mm": Decimal("0.001"), "cm": Decimal("0.01"), "m": Decimal(1),
               "km": Decimal(1000)},
    "mass": {"mg": Decimal("0.001"), "g": Decimal(1), "kg": Decimal(1000)},
    "time": {"s": Decimal(1), "min": Decimal(60), "h": Decimal(3600)},
}

Kind = Literal["length", "mass", "time"]
INSTRUCTION = "End with 'Answer: <number>'."


class UnitParams(TaskParams):
    """Which kinds of units the items convert between."""

    kinds: list[Kind] = Field(default=["length", "mass", "time"], min_length=1,
                              description="Kinds of units drawn from: length, mass, time.")


def _text(value: Decimal) -> str:
    """A decimal without trailing zeros or an exponent (3500, 0.035)."""
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


class UnitConversion(TaskSource):
    """Convert a quantity between two units of one kind."""

    name: ClassVar[str] = "units.conversion"
    description: ClassVar[str] = "Convert a quantity between units (length, mass, time)."
    domain: ClassVar[str] = "math"
    version: ClassVar[str] = "1"
    Params: ClassVar[type[UnitParams]] = UnitParams
    params: UnitParams

    def _draw(self, rng: random.Random) -> tuple[str, tuple[str, str, str, str]]:
        kind = rng.choice(sorted(self.params.kinds))
        source, target = rng.sample(sorted(UNITS[kind]), 2)
        quantity = Decimal(rng.randint(1, 200)) / rng.choice([1, 2, 4, 10])
        answer = quantity * UNITS[kind][source] / UNITS[kind][target]
        value = _text(quantity)
        return f"{value} {source} {target}", (value, source, target, _text(answer))

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        rng = seeded_rng(self.name, self.params.draw_key(), seed, split)
        demo = ("Convert 2 m to cm. " + INSTRUCTION, "2 m = 2 x 100 cm = 200 cm.\nAnswer: 200")
        drawn = draw_distinct(self._draw, split, size, rng, exclude=frozenset({"2 m cm"}),
                              what="conversions")
        return [Example(
            id=f"{split}-{seed}-{i}",
            messages=one_shot(None, *demo, f"Convert {value} {source} to {target}. "
                              + INSTRUCTION),
            reference=f"{value} {source} = {answer} {target}.\nAnswer: {answer}",
            answer=answer) for i, (value, source, target, answer) in enumerate(drawn)]

    def grade(self, example: Example, completion: str) -> Grade:
        line = extract_answer_line(completion)
        if line is None:
            return Grade(0.0, False, "The response has no 'Answer: <number>' line.",
                         format_error=True)
        given, gold = parse_number(line.split()[0] if line.split() else ""), \
            parse_number(example.answer)
        assert gold is not None  # the generator writes plain decimals
        if given is not None and abs(given - gold) <= abs(gold) / 10**6:
            return Grade(1.0, True)
        return Grade(0.0, False, f"The answer {line[:40]} is wrong.")
