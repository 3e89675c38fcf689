"""The data tables behind the science sources, and formula arithmetic.

Tables in `clbench/data/science/`: all 118 elements (IUPAC standard atomic weights, abridged),
~90 compounds with common names, units per quantity, physical constants. Formula arithmetic:
atoms per element of a formula with parentheses (:func:`formula_counts`) and molar masses
(:func:`molar_mass`).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "science"


@dataclass(frozen=True)
class Element:
    number: int
    symbol: str
    name: str
    group: int | None
    period: int
    molar_mass: float | None   # None: no standard atomic weight (no stable isotope)


@lru_cache(maxsize=1)
def elements() -> tuple[Element, ...]:
    """The periodic table (IUPAC standard atomic weights, abridged)."""
    text = (DATA_DIR / "elements.csv").read_text("utf-8")
    return tuple(Element(int(r["number"]), r["symbol"], r["name"],
                         int(r["group"]) if r["group"] else None, int(r["period"]),
                         float(r["molar_mass"]) if r["molar_mass"] else None)
                 for r in csv.DictReader(text.splitlines()))


@lru_cache(maxsize=1)
def compounds() -> tuple[tuple[str, str], ...]:
    """(formula, common name) pairs."""
    text = (DATA_DIR / "compounds.csv").read_text("utf-8")
    return tuple((r["formula"], r["name"]) for r in csv.DictReader(text.splitlines()))


@lru_cache(maxsize=1)
def _json_table(name: str) -> dict[str, Any]:
    text = (DATA_DIR / name).read_text("utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def constants() -> dict[str, Any]:
    return _json_table("constants.json")


def units() -> dict[str, dict[str, float]]:
    return _json_table("units.json")


_TOKEN = re.compile(r"([A-Z][a-z]?|\(|\)|\d+)")


def formula_counts(formula: str) -> dict[str, int]:
    """Atoms per element of a formula with parentheses: `Ca(OH)2` -> {Ca: 1, O: 2, H: 2}."""
    tokens = _TOKEN.findall(formula)
    if "".join(tokens) != formula:
        raise ValueError(f"cannot parse formula {formula!r}")
    stack: list[dict[str, int]] = [{}]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "(":
            stack.append({})
            continue
        mult = 1
        if i < len(tokens) and tokens[i].isdigit():
            mult = int(tokens[i])
            i += 1
        if tok == ")":
            if len(stack) == 1:
                raise ValueError(f"unbalanced parentheses in formula {formula!r}")
            group = stack.pop()
            for el, n in group.items():
                stack[-1][el] = stack[-1].get(el, 0) + n * mult
        elif tok.isdigit():
            raise ValueError(f"misplaced count in formula {formula!r}")
        else:
            stack[-1][tok] = stack[-1].get(tok, 0) + mult
    if len(stack) != 1:
        raise ValueError(f"unbalanced parentheses in formula {formula!r}")
    return stack[0]


def molar_mass(formula: str) -> float:
    """Molar mass in g/mol from standard atomic weights."""
    by_symbol = {e.symbol: e for e in elements()}
    total = 0.0
    for sym, n in formula_counts(formula).items():
        mass = by_symbol[sym].molar_mass
        if mass is None:
            raise ValueError(f"{sym} has no standard atomic weight")
        total += n * mass
    return total
