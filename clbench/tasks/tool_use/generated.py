"""Tool-use base and the generated function-calling family.

* The shared base of every tool-use source: :class:`ToolUseSource` (grading through
  :mod:`clbench.tasks.tool_use.calls`, BFCL semantics and verifier feedback), the answer formats the
  prompts ask for, and call formatting (`call_json`, `function_listing`, `reference_arguments`).
* `tool_use.generated` (and `tool_use.generated_unseen`, its held-out function families):
  requests written from templates over function schemas kept in `clbench/data/tools/`, each with
  one deterministic expected call. Difficulty knobs: candidate functions in the prompt, the
  function of the worked example (same as the request's, or another one), optional arguments,
  unit/format conversions the model must do (hours -> minutes, "March 5" -> "2025-03-05").

The hub and benchmark adapters build on this base: BFCL in :mod:`clbench.tasks.tool_use.bfcl`,
ToolAlpaca in :mod:`clbench.tasks.tool_use.toolalpaca`.
"""

from __future__ import annotations

import calendar
import hashlib
import json
from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar

from pydantic import Field, model_validator

from clbench.errors import UserError
from clbench.tasks.base import (
    Example,
    Grade,
    Split,
    TaskParams,
    TaskSource,
    one_shot,
    reasoned,
    seeded_rng,
    split_of,
    think_field_description,
)
from clbench.tasks.tool_use.calls import NO_CALL_FEEDBACK, calls_start, grade_calls

JSON_FORMAT = 'Respond with only a JSON object of the form {"name": ..., "arguments": {...}}.'
JSON_LIST_FORMAT = ('Respond with only a JSON list with one object per call, each of the form '
                    '{"name": ..., "arguments": {...}}.')


class ToolUseError(UserError):
    """A tool-use task cannot be built as configured (missing data, impossible sizes)."""


def call_json(name: str, arguments: dict[str, Any]) -> str:
    """The canonical JSON text of one call (the answer format every prompt asks for)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def function_listing(schemas: list[dict]) -> str:
    """System prompt: the functions offered and the answer format."""
    plural = "s" if len(schemas) > 1 else ""
    return f"You have access to the following function{plural}:\n{json.dumps(schemas)}\n"


class ToolUseSource(TaskSource):
    """Shared grading: `answer` holds the expected calls and the schemas of their functions."""

    domain: ClassVar[str] = "tool_use"

    def grade(self, example: Example, completion: str) -> Grade:
        expected = example.answer["calls"]
        schemas = {s["name"]: s for s in example.answer.get("schemas", [])}
        correct, feedback = grade_calls(completion, expected, schemas)
        return Grade(reward=1.0 if correct else 0.0, correct=correct, feedback=feedback,
                     format_error=feedback == NO_CALL_FEEDBACK)

    def answer_start(self, completion: str) -> int:
        """The call itself is the answer; any "Thought:" text before it is the reasoning."""
        start = calls_start(completion)
        return start if start is not None else super().answer_start(completion)


def call_response(fn: dict, arguments: dict[str, Any], think: bool) -> str:
    """The response that makes a call: its JSON, after a one-line working in the reasoning
    format (which function the request needs; kept short so a call fits the starter's token
    cap)."""
    call = call_json(fn["name"], arguments)
    return reasoned(f"The request needs {fn['name']}.", call, think) if think else call


def reference_arguments(allowed: dict[str, list], required: list[str] = ()) -> dict[str, Any]:
    """One correct argument set: the first allowed value of each argument, omitting optional
    ones whose first option is `""` (unless the schema requires them: BFCL has a few such).
    Nested allowed-value structures (dicts of lists) become concrete values the same way."""
    out = {}
    for param, opts in allowed.items():
        values = [o for o in opts if o != ""]
        if values and (opts[0] != "" or param in required):
            out[param] = _concrete(values[0])
    return out


def _concrete(value: Any) -> Any:
    if isinstance(value, dict) and all(isinstance(v, list) for v in value.values()):
        return reference_arguments(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_concrete(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# The generated family
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def load_families() -> dict[str, Any]:
    """The function families and value slots shipped in `clbench/data/tools/families.json`."""
    text = resources.files("clbench").joinpath("data/tools/families.json").read_text("utf-8")
    return json.loads(text)


_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve"]


def _plural(n: int, unit: str) -> str:
    return f"{'an' if unit == 'hour' else 'a'} {unit}" if n == 1 else f"{n} {unit}s"


def draw_slot(slot: dict, rng: Any, convert: bool) -> tuple[Any, str]:
    """(value the call must carry, how the request says it); `convert` picks the phrasing the
    model must translate (words for numbers, hours for minutes, month names for ISO dates)."""
    kind = slot["kind"]
    if kind == "pool":
        value = rng.choice(slot["values"])
        return value, value
    if kind == "enum":
        value = rng.choice(sorted(slot["say"]))
        return value, rng.choice(slot["say"][value])
    if kind in ("int", "percent"):
        value = rng.randrange(slot["min"], slot["max"] + 1, slot.get("step", 1))
        if kind == "percent":
            return value, f"{value} percent" if convert else f"{value}%"
        return value, _WORDS[value] if convert and value < len(_WORDS) else str(value)
    if kind == "float":
        steps = int((slot["max"] - slot["min"]) / slot["step"])
        value = slot["min"] + slot["step"] * rng.randrange(steps + 1)
        return value, f"{value:g}"
    if kind == "money":
        value = round(rng.randrange(slot["min"] * 4, slot["max"] * 4 + 1) / 4, 2)
        return value, f"{value:.2f}" if value % 1 else str(int(value))
    if kind == "date":
        month, day = rng.randrange(1, 13), rng.randrange(1, 29)
        value = f"{slot['year']}-{month:02d}-{day:02d}"
        if convert:
            return value, rng.choice([f"{calendar.month_name[month]} {day}, {slot['year']}",
                                      f"{day} {calendar.month_name[month]} {slot['year']}"])
        return value, value
    if kind == "time":
        hour, minute = rng.randrange(7, 21), rng.choice([0, 15, 30, 45])
        value = f"{hour:02d}:{minute:02d}"
        if convert:
            h12 = hour - 12 if hour > 12 else hour
            suffix = "pm" if hour >= 12 else "am"
            return value, f"{h12} {suffix}" if minute == 0 else f"{h12}:{minute:02d} {suffix}"
        return value, value
    if kind in ("minutes", "seconds"):
        value = rng.choice(slot["choices"])
        small, big = ("minute", "hour") if kind == "minutes" else ("second", "minute")
        if convert and value >= 60:
            whole, rest = divmod(value, 60)
            text = _plural(whole, big) + (f" and {_plural(rest, small)}" if rest else "")
            return value, text
        return value, _plural(value, small)
    if kind == "email":
        value = f"{rng.choice(slot['names'])}@{rng.choice(slot['domains'])}"
        return value, value
    if kind == "phone":
        value = f"+1-555-{rng.randrange(100, 1000)}-{rng.randrange(1000, 10000)}"
        return value, value
    if kind == "code":
        value = slot["prefix"] + "".join(str(rng.randrange(10)) for _ in range(slot["digits"]))
        return value, value
    if kind == "flag":
        return True, ""
    raise ToolUseError(f"unknown slot kind {kind!r} in families.json")


def function_schema(fn: dict, slots: dict[str, dict]) -> dict:
    """The JSON-Schema declaration of a generated function, as shown to the model."""
    props = {}
    for pname, p in fn["params"].items():
        prop: dict[str, Any] = {"type": p["type"], "description": p["description"]}
        slot = slots[p["slot"]]
        if slot["kind"] == "enum":
            prop["enum"] = sorted(slot["say"])
        props[pname] = prop
    required = [n for n, p in fn["params"].items() if not p.get("optional")]
    return {"name": fn["name"], "description": fn["description"],
            "parameters": {"type": "object", "properties": props, "required": required}}


class GeneratedParams(TaskParams):
    """Difficulty knobs of the generated tool-calling family."""

    families: list[str] | None = Field(default=None, description="Function families to draw "
                                       "from; default: the seen families of families.json.")
    n_functions: int = Field(default=3, ge=1, le=8, description="Candidate functions listed in "
                             "the prompt (the right one plus distractors, same family first).")
    demo_same_function: float = Field(default=0.5, ge=0.0, le=1.0, description="Probability "
                                      "that the worked example calls the request's own function "
                                      "(else another listed one: much harder for small models).")
    optional_rate: float = Field(default=0.5, ge=0.0, le=1.0, description="Probability that the "
                                 "request states each optional argument.")
    conversion_rate: float = Field(default=0.5, ge=0.0, le=1.0, description="Probability that a "
                                   "value is phrased so the model must convert it (hours to "
                                   "minutes, month names to ISO dates, number words, 12-hour "
                                   "times).")
    max_args: int = Field(default=8, ge=1, description="Largest number of arguments in an "
                          "expected call.")
    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="Share of distinct "
                                 "calls assigned to the eval split.")
    think: bool = Field(default=False, description=think_field_description() + " The working "
                        "names the function the request needs.")

    @model_validator(mode="after")
    def _demo_needs_another_function(self) -> GeneratedParams:
        if self.n_functions == 1 and self.demo_same_function < 1.0:
            raise ValueError("an example with another function needs n_functions >= 2 "
                             "(or set demo_same_function: 1.0)")
        return self


class GeneratedTools(ToolUseSource):
    """Generated function-calling requests with deterministic expected calls."""

    name: ClassVar[str] = "tool_use.generated"
    description: ClassVar[str] = ("Generated function calls over weather, travel, finance, "
                                  "messaging, smart-home and shopping tools, with conversions")
    Params: ClassVar[type[TaskParams]] = GeneratedParams
    default_families: ClassVar[str] = "seen_families"

    def __init__(self, params: TaskParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        data = load_families()
        self.slots: dict[str, dict] = data["slots"]
        names = self.params.families or data[self.default_families]
        unknown = [f for f in names if f not in data["families"]]
        if unknown:
            raise ToolUseError(f"unknown tool families {unknown}; known: "
                               f"{sorted(data['families'])}")
        self.functions = [(fam, fn) for fam in names for fn in data["families"][fam]]
        self.all_functions = [(fam, fn) for fam, fns in data["families"].items() for fn in fns]
        if self.params.n_functions > len(self.all_functions):
            raise ToolUseError(f"n_functions={self.params.n_functions} exceeds the "
                               f"{len(self.all_functions)} functions available")

    def _request(self, fn: dict, rng: Any) -> tuple[str, dict[str, Any], dict[str, list]]:
        """(request text, call arguments, allowed values per argument)."""
        p = self.params
        fills: dict[str, str] = {}
        args: dict[str, Any] = {}
        allowed: dict[str, list] = {}
        used: set[str] = set()
        for pname, spec in fn["params"].items():
            for _ in range(8):  # two arguments from one slot differ (no flight Paris -> Paris)
                value, surface = draw_slot(self.slots[spec["slot"]], rng,
                                           rng.random() < p.conversion_rate)
                if repr((spec["slot"], value)) not in used:
                    break
            used.add(repr((spec["slot"], value)))
            if spec.get("optional"):
                if rng.random() < p.optional_rate:
                    fills[pname] = rng.choice(spec["clause"]).format(surface)
                    args[pname] = value
                    allowed[pname] = [value]
                else:
                    fills[pname] = ""
                    allowed[pname] = ["", spec["default"]] if "default" in spec else [""]
            else:
                fills[pname] = surface
                args[pname] = value
                allowed[pname] = [value]
        text = rng.choice(fn["templates"]).format(**fills)
        return text[0].upper() + text[1:], args, allowed

    def _item(self, split: Split, rng: Any) -> tuple[str, Example] | None:
        p = self.params
        family, fn = rng.choice(self.functions)
        request, args, allowed = self._request(fn, rng)
        if len(args) > p.max_args:
            return None
        key = call_json(fn["name"], dict(sorted(args.items())))
        if split_of("tool_use.generated:" + key, p.eval_fraction) != split:
            return None
        same = [f for fam, f in self.all_functions if fam == family and f is not fn]
        other = [f for fam, f in self.all_functions if fam != family]
        rng.shuffle(same)
        rng.shuffle(other)
        candidates = [fn] + (same + other)[: p.n_functions - 1]
        demo_fn = fn if rng.random() < p.demo_same_function else rng.choice(candidates[1:])
        demo_request, demo_args, _ = self._request(demo_fn, rng)
        for _ in range(8):  # the example must not give the answer away
            if demo_request != request and demo_args != args:
                break
            demo_request, demo_args, _ = self._request(demo_fn, rng)
        rng.shuffle(candidates)
        schemas = [function_schema(f, self.slots) for f in candidates]
        think = p.think
        system = function_listing(schemas) + JSON_FORMAT
        messages = one_shot(system, demo_request, call_response(demo_fn, demo_args, think),
                            request, think)
        example = Example(
            id="toolgen-" + hashlib.sha256(key.encode()).hexdigest()[:12],
            messages=messages,
            reference=call_response(fn, args, think),
            answer={"calls": [{"name": fn["name"], "arguments": allowed}],
                    "schemas": [function_schema(fn, self.slots)]},
            metadata={"family": family, "function": fn["name"], "n_args": len(args),
                      "demo_function": demo_fn["name"], "n_functions": len(candidates)},
        )
        return key, example

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        rng = seeded_rng(self.name, self.params.draw_key(), split, seed)
        seen: set[str] = set()
        out: list[Example] = []
        misses = 0  # draws in a row that gave nothing new: the item space is exhausted
        while len(out) < size and misses < 2000:
            made = self._item(split, rng)
            if made and made[0] not in seen:
                seen.add(made[0])
                out.append(made[1])
                misses = 0
            else:
                misses += 1
        if len(out) == size:
            return out
        raise ToolUseError(f"{self.name}: could only draw {len(out)} distinct {split} items of "
                           f"{size}; use more families or a larger max_args")


class GeneratedToolsUnseen(GeneratedTools):
    """The generated family over function families the seen variant never shows (OOD)."""

    name: ClassVar[str] = "tool_use.generated_unseen"
    description: ClassVar[str] = ("Generated function calls over held-out families (health, "
                                  "media): an OOD probe for tool_use.generated")
    default_families: ClassVar[str] = "unseen_families"
