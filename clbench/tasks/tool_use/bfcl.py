"""BFCL sources: the Berkeley Function-Calling Leaderboard's categories as tool-use tasks.

`tool_use.bfcl_simple` / `bfcl_multiple` / `bfcl_parallel` read BFCL v4's data and possible
answers from the installed `bfcl-eval` package (:func:`load_bfcl`) and grade through the shared
tool-use base (:class:`clbench.tasks.tool_use.generated.ToolUseSource`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import ClassVar

from pydantic import Field

from clbench.tasks.base import Example, Split, TaskParams, one_shot, seeded_rng, split_of
from clbench.tasks.tool_use.generated import (
    JSON_FORMAT,
    JSON_LIST_FORMAT,
    ToolUseError,
    ToolUseSource,
    call_json,
    reference_arguments,
)

BFCL_INSTALL_HINT = ("the BFCL tool-use tasks read their data from the `bfcl-eval` package; "
                     "install it with `pip install --no-deps bfcl-eval` (its pinned dependencies "
                     "are not needed)")


def _read_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@lru_cache(maxsize=8)
def load_bfcl(category: str) -> tuple[tuple[dict, dict], ...]:
    """(question record, possible-answer record) pairs of one BFCL v4 category, by id."""
    try:
        root = resources.files("bfcl_eval").joinpath("data")
    except ModuleNotFoundError:
        raise ToolUseError(BFCL_INSTALL_HINT) from None
    name = f"BFCL_v4_{category}.json"
    try:
        questions = _read_jsonl(root.joinpath(name).read_text("utf-8"))
        answers = _read_jsonl(root.joinpath("possible_answer", name).read_text("utf-8"))
    except FileNotFoundError:
        raise ToolUseError(f"the installed bfcl-eval has no {name}; {BFCL_INSTALL_HINT}") from None
    by_id = {a["id"]: a for a in answers}
    return tuple((q, by_id[q["id"]]) for q in questions if q["id"] in by_id)


def bfcl_expected(answer: dict) -> list[dict]:
    """BFCL's `ground_truth` ([{fn: {param: [allowed]}}]) as expected calls."""
    return [{"name": name, "arguments": args}
            for entry in answer["ground_truth"] for name, args in entry.items()]


def _take(items: list[Example], split: Split, size: int, what: str) -> list[Example]:
    if size > len(items):
        raise ToolUseError(f"{what} has only {len(items)} {split} items, {size} were asked for; "
                           "ask for fewer or change `eval_fraction`")
    return items[:size]


class BFCLParams(TaskParams):
    """Parameters of the BFCL sources."""

    eval_fraction: float = Field(default=1.0, gt=0.0, le=1.0, description="Share of the "
                                 "category's items in the eval split (1.0: all, no train split).")
    demo: bool = Field(default=True, description="Show one worked request and call (another "
                       "item of the category, from the train split) before the request.")


class _BFCL(ToolUseSource):
    """One BFCL category: request, functions, and possible answers with BFCL's semantics."""

    category: ClassVar[str]
    license: ClassVar[str] = "Apache-2.0"
    Params: ClassVar[type[TaskParams]] = BFCLParams

    def _messages(self, question: dict, expected: list[dict], demo: tuple | None) -> list:
        fmt = JSON_LIST_FORMAT if len(expected) > 1 else JSON_FORMAT

        def turn(q: dict) -> str:
            request = "\n".join(m["content"] for m in q["question"][0] if m["role"] == "user")
            return f"Functions: {json.dumps(q['function'])}\n\nRequest: {request}"

        system = "You call functions to fulfil requests. " + fmt
        if demo is None:
            return [{"role": "system", "content": system},
                    {"role": "user", "content": turn(question)}]
        demo_q, demo_a = demo
        demo_calls = [json.loads(call_json(c["name"], reference_arguments(c["arguments"])))
                      for c in bfcl_expected(demo_a)]
        demo_text = (json.dumps(demo_calls, ensure_ascii=False) if len(demo_calls) > 1
                     else json.dumps(demo_calls[0], ensure_ascii=False))
        return one_shot(system, turn(demo_q), demo_text, turn(question))

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        records = load_bfcl(self.category)
        p = self.params
        mine = [r for r in records if split_of("bfcl:" + r[0]["id"], p.eval_fraction) == split]
        demos = [r for r in records if split_of("bfcl:" + r[0]["id"], p.eval_fraction) == "train"]
        rng = seeded_rng(self.name, split, seed)
        rng.shuffle(mine)
        out = []
        for question, answer in mine[:size]:
            expected = bfcl_expected(answer)
            pool = [d for d in (demos or records) if d[0]["id"] != question["id"]]
            demo = rng.choice(pool) if p.demo and pool else None
            required = {f["name"]: f["parameters"].get("required", [])
                        for f in question["function"]}
            refs = [{"name": c["name"],
                     "arguments": reference_arguments(c["arguments"], required.get(c["name"], []))}
                    for c in expected]
            reference = (json.dumps(refs, ensure_ascii=False) if len(refs) > 1
                         else call_json(refs[0]["name"], refs[0]["arguments"]))
            names = {c["name"] for c in expected}
            out.append(Example(
                id=question["id"],
                messages=self._messages(question, expected, demo),
                reference=reference,
                answer={"calls": expected,
                        "schemas": [f for f in question["function"] if f["name"] in names]},
                metadata={"category": self.category, "n_calls": len(expected),
                          "n_functions": len(question["function"])},
            ))
        return _take(out, split, size, f"{self.name} (eval_fraction={p.eval_fraction})")


class BFCLSimple(_BFCL):
    """BFCL v4 simple (Python): one function offered, one call expected."""

    name: ClassVar[str] = "tool_use.bfcl_simple"
    description: ClassVar[str] = "BFCL v4 simple_python: one function, one call (400 items)"
    category: ClassVar[str] = "simple_python"


class BFCLMultiple(_BFCL):
    """BFCL v4 multiple: several functions offered, the right one must be chosen."""

    name: ClassVar[str] = "tool_use.bfcl_multiple"
    description: ClassVar[str] = "BFCL v4 multiple: choose one of 2-4 functions (200 items)"
    category: ClassVar[str] = "multiple"


class BFCLParallel(_BFCL):
    """BFCL v4 parallel: several calls of one function in one answer, any order."""

    name: ClassVar[str] = "tool_use.bfcl_parallel"
    description: ClassVar[str] = "BFCL v4 parallel: several calls in one answer (200 items)"
    category: ClassVar[str] = "parallel"
