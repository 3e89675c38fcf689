"""Task files' templates: Jinja2 in its immutable sandbox, bounded in time and length.

Templates read a record's fields and call the filters below, never Python a file names: no
attribute starting with `_`, no imports, no mutation. One rendering may take
:data:`RENDER_BUDGET_S` (enforced on the main thread) and produce :data:`MAX_RENDERED_CHARS`.
"""

from __future__ import annotations

import json
import string
from functools import lru_cache
from typing import Any

import regex

from clbench.errors import UserError
from clbench.spec.reading import SpecError
from clbench.tasks.grading import TimeLimitExceeded, extract_boxed, time_limit
from clbench.tasks.hub import stable_key

#: One rendering may take this long (on the main thread) and produce this many characters.
RENDER_BUDGET_S = 1.0
MAX_RENDERED_CHARS = 100_000
#: Option letters of multiple-choice tasks.
LETTERS = string.ascii_uppercase


class TaskFileError(UserError):
    """A task file's template or grader arguments fail on a record."""


class RecordTooLong(TaskFileError):
    """A template renders more than :data:`MAX_RENDERED_CHARS` of one record (the record is
    skipped: its data, not the template, is at fault)."""


#: A template's regular expression gets this long on one value (a signal cannot stop one).
REGEX_BUDGET_S = 0.5


def _regex_replace(value: Any, pattern: str, replacement: str = "") -> str:
    return regex.sub(pattern, replacement, str(value), timeout=REGEX_BUDGET_S)


def _regex_search(value: Any, pattern: str, group: int = 0) -> str:
    found = regex.search(pattern, str(value), timeout=REGEX_BUDGET_S)
    return found.group(group) if found else ""


def _from_json(value: Any) -> Any:
    text = str(value)
    if len(text) > MAX_RENDERED_CHARS * 10:
        raise ValueError(f"fromjson: {len(text):,} characters, too long")
    return json.loads(text)


def _letter(index: Any) -> str:
    return LETTERS[int(index)]


def _bounded_binop(env: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
    """`*` and `**` as Python computes them, unless the result would be too large to render:
    `'a' * 10**10` and `9 ** 9 ** 9` are refused before any memory is taken."""
    from jinja2.sandbox import SecurityError

    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                    len(seq) * max(times, 0) > MAX_RENDERED_CHARS:
                raise SecurityError(f"a repetition of {len(seq) * times:,} items is too large")
    if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
        raise SecurityError(f"an exponent of {right} is too large")
    return env.binop_table[operator](left, right)


@lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            return _bounded_binop(self, context, operator, left, right)

    env = Bounded(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters.update(regex_replace=_regex_replace, regex_search=_regex_search,
                       boxed=lambda v: extract_boxed(str(v)) or "", letter=_letter,
                       hash=lambda *parts: stable_key(*parts), fromjson=_from_json)
    return env


class Template:
    """One template (or, with `expression`, one Jinja2 expression) of a task file."""

    def __init__(self, text: str, field: str, task: str, expression: bool = False) -> None:
        from jinja2 import TemplateError

        self.field, self.task = field, task
        try:
            env = _environment()
            self._render = env.compile_expression(text) if expression else \
                env.from_string(text).render
        except TemplateError as exc:
            raise SpecError(f"{task}: {field}: not a valid template: {exc}") from None

    def __call__(self, record: dict[str, Any]) -> Any:
        from jinja2 import TemplateError

        try:
            with time_limit(RENDER_BUDGET_S):
                value = self._render(**record)
        except TemplateError as exc:
            raise TaskFileError(f"{self.task}: {self.field}: {exc}") from None
        except TimeLimitExceeded:
            raise TaskFileError(f"{self.task}: {self.field}: rendering one record took more "
                                f"than {RENDER_BUDGET_S:g} s") from None
        except Exception as exc:  # a filter given the wrong kind of value, say
            raise TaskFileError(f"{self.task}: {self.field}: {type(exc).__name__}: "
                                f"{str(exc)[:200]}") from None
        if isinstance(value, str) and len(value) > MAX_RENDERED_CHARS:
            raise RecordTooLong(f"{self.task}: {self.field}: renders {len(value):,} characters "
                                f"(at most {MAX_RENDERED_CHARS:,})")
        return value
