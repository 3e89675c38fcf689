"""The task contract: what every task source produces and how it grades.

A task source is registered in the `clbench.tasks` entry-point group. It produces examples
deterministically from (split, seed, size) and grades completions into a :class:`Grade`. Graders
are pure functions of (example, completion) and must return quickly on adversarial output.
"""

from __future__ import annotations

import hashlib
import os
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from clbench.errors import UserError

Split = Literal["train", "eval"]
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One task item.

    `messages` is the chat-formatted prompt (a list of `{"role", "content"}` dicts, ending with
    the user turn the model must answer, or after it with an assistant turn holding the start of
    the response: a prefix the model continues, e.g. the opened reasoning block of the `think`
    format, see :func:`response_prefix`). `reference` is a correct response in the task's output
    format (short reasoning + final answer) used by SFT and as a fallback demonstration. `answer`
    is the gold answer in whatever JSON-serialisable form the grader needs.
    """

    id: str
    messages: Messages
    reference: str
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grade:
    """The verdict on one completion: reward in [0, 1], correctness, verifier feedback.

    `format_error` says the completion held no answer the grader could read (no `\\boxed{}`, no
    `Answer:` line, no function call): its feedback is about the format, not the value, and is
    the only feedback SDPO's `feedback: format` passes on (as the reference's math verifier)."""

    reward: float
    correct: bool
    feedback: str | None = None
    format_error: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must lie in [0, 1], got {self.reward}")


class TaskParams(BaseModel):
    """Base of a task source's parameters (empty by default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Parameters that change how items are written, not which items are drawn: left out of
    #: :meth:`draw_key`, so adding one (at any value) keeps every suite's items as they were.
    FORMAT_ONLY: ClassVar[frozenset[str]] = frozenset({"think"})

    def draw_key(self) -> str:
        """The parameters that decide which items are drawn, as canonical JSON (the seed of a
        source's item generator)."""
        return self.model_dump_json(exclude=set(self.FORMAT_ONLY & set(type(self).model_fields)))


#: Items drawn in this process, by (source class, parameters, split, seed, size), the most
#: recent :data:`DRAWN_KEPT` draws: a source's items are a pure function of these (the contract
#: above), so each is drawn once.
_DRAWN: OrderedDict[tuple[Any, ...], tuple[Example, ...]] = OrderedDict()
DRAWN_KEPT = 256


class TaskSource(ABC):
    """A source of examples for one task, with its grader.

    Subclasses set the class attributes and implement :meth:`build` and :meth:`grade`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    domain: ClassVar[str]              # "math", "science", "tool_use", ...
    origin: ClassVar[str] = "offline"  # "offline" (ships with clbench) or "hub"
    # Bumped whenever the items a seed gives or their grading change: results record it, and
    # runs of different versions are neither compared together nor share a cached row 0.
    version: ClassVar[str] = "1"
    license: ClassVar[str] = "Apache-2.0"
    Params: ClassVar[type[TaskParams]] = TaskParams
    #: Whether completions are graded in parallel (:func:`grade_all`): for graders that wait on
    #: other processes (code run in a sandbox), not for those that compute in Python.
    grades_in_parallel: ClassVar[bool] = False
    #: Whether grading runs the completion as code (in the sandbox): a run records how the
    #: sandbox was made (`versions["code_sandbox"]`).
    runs_code: ClassVar[bool] = False

    def __init__(self, params: TaskParams | dict[str, Any] | None = None) -> None:
        if not isinstance(params, TaskParams):
            params = self.Params.model_validate(params or {})
        self.params = params

    def examples(self, split: Split, seed: int, size: int) -> list[Example]:
        """`size` items of `split`, the same for the same (params, split, seed, size): drawn
        once per process (:data:`_DRAWN`), however often a run's validation, its columns and
        its training sets, or a sweep's runs, ask for them."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        key = (type(self), self.params.model_dump_json(), split, seed, size)
        drawn = _DRAWN.get(key)
        if drawn is None:
            drawn = _DRAWN[key] = tuple(self.build(split, seed, size))
            while len(_DRAWN) > DRAWN_KEPT:
                _DRAWN.popitem(last=False)
        else:
            _DRAWN.move_to_end(key)
        return list(drawn)

    @abstractmethod
    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        """Produce the items; train and eval must never share an item."""

    @abstractmethod
    def grade(self, example: Example, completion: str) -> Grade:
        """Grade a completion of `example`. Pure, bounded in time on any input."""

    @classmethod
    def content_digest(cls) -> str | None:
        """A digest of what the source is made from when that is data rather than code (a task
        file's content), so that an edit without a version bump still keys caches apart; None
        for a source written in Python (its `version` says it all)."""
        return None

    def answer_start(self, completion: str) -> int:
        """Character offset where the final answer of a completion starts.

        Used by SDPO's `supervision: final_line` (an ablation: tokens from this offset on get a
        target). Default: after the last `</think>` if present, else the start of the last
        non-empty line.
        """
        return default_answer_start(completion)

    def answer_start_for(self, example: Example) -> Callable[[str], int]:
        """:meth:`answer_start` for completions of `example` (the joint reference's mixture of
        tasks answers with the task the example comes from)."""
        return self.answer_start

    def max_new_tokens_for(self, example: Example) -> int | None:
        """A tighter token cap than the stage's for rollouts of `example`, or None (the
        stage's). The joint reference's mixture gives each item its own stage's cap."""
        return None


#: Completions graded at once by the graders that run in parallel.
GRADING_WORKERS = max(2, os.cpu_count() or 1)


def grade_all(items: Sequence[tuple[TaskSource, Example, str]]) -> list[Grade]:
    """Grade each `(task, example, completion)`, in order: those of tasks that grade in
    parallel (:attr:`TaskSource.grades_in_parallel`) across :data:`GRADING_WORKERS` threads,
    the others here, in this thread (a grader's time limit works in the main thread only)."""
    grades: list[Grade | None] = [None] * len(items)
    parallel = [i for i, (task, _, _) in enumerate(items) if task.grades_in_parallel]
    pool = ThreadPoolExecutor(GRADING_WORKERS) if len(parallel) > 1 else None
    try:
        futures = {i: pool.submit(items[i][0].grade, items[i][1], items[i][2])
                   for i in parallel} if pool is not None else {}
        for i, (task, example, completion) in enumerate(items):
            if i not in futures:
                grades[i] = task.grade(example, completion)
        for i, future in futures.items():
            grades[i] = future.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return grades  # type: ignore[return-value]


def think_field_description() -> str:
    """The documentation of the offline families' `think` parameter (one wording for all)."""
    return ("Reasoning format: the worked example (and every reference solution) puts its working "
            "inside `<think>...</think>` before the final answer, and the prompt opens the block "
            "of the response to write (as reasoning models' chat templates do); `sdpo` then "
            "supervises the answer after the block, `sdpo-cot` the block too (docs/tasks.md).")


#: The tags of a reasoning block; its answer follows the closing one.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: The start of every response in the reasoning format, written into the prompt (the way the
#: chat templates of reasoning models such as Qwen3-Thinking open the block): the model writes
#: its working, closes the block and answers.
THINK_PREFIX = THINK_OPEN + "\n"


def split_response_start(messages: Messages) -> tuple[Messages, str]:
    """`(chat, start)`: a chat that ends with an assistant turn holds the start of the response
    (the model continues it, e.g. an opened reasoning block): the turns before it and its
    content; any other chat is returned whole, with start "" ."""
    if messages and messages[-1].get("role") == "assistant":
        return list(messages[:-1]), messages[-1].get("content") or ""
    return list(messages), ""


def response_prefix(messages: Messages) -> str:
    """The start of the response a prompt already holds ("" when it ends with the user's
    turn): :func:`split_response_start`'s second part."""
    return split_response_start(messages)[1]


def opens_reasoning(prefix: str) -> bool:
    """Whether a response start leaves a reasoning block open (a `<think>` not closed after)."""
    return prefix.rfind(THINK_OPEN) > prefix.rfind(THINK_CLOSE)


def continuation(example: Example) -> str:
    """What the model writes of `example`'s reference solution: the reference after the
    response prefix the prompt holds (SFT's target; a reference scored as a completion)."""
    prefix = response_prefix(example.messages)
    if prefix and not example.reference.startswith(prefix):
        raise ValueError(f"{example.id}: the reference does not start with the response prefix "
                         f"{prefix!r} its prompt holds")
    return example.reference[len(prefix):]


def reasoned(working: str, final: str, think: bool) -> str:
    """A response of working then final answer: ``working\nfinal``, or in the reasoning format
    ``<think>\nworking\n</think>\nfinal``."""
    if think:
        return f"{THINK_PREFIX}{working}\n{THINK_CLOSE}\n{final}"
    return f"{working}\n{final}" if working else final


def default_answer_start(completion: str) -> int:
    """After the last `</think>`; else the start of the last non-empty line; else 0."""
    think = completion.rfind(THINK_CLOSE)
    if think >= 0:
        return think + len(THINK_CLOSE)
    stripped = completion.rstrip()
    if not stripped:
        return 0
    return stripped.rfind("\n") + 1


def split_of(key: str, eval_fraction: float = 0.2) -> Split:
    """Deterministic split assignment from an item's canonical key (disjoint by construction)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "eval" if (h % 10_000) < eval_fraction * 10_000 else "train"


def seeded_rng(*parts: Any) -> random.Random:
    """A `random.Random` seeded from a stable hash of `parts` (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def one_shot(system: str | None, demo_user: str, demo_assistant: str, user: str,
             think: bool = False) -> Messages:
    """A chat with one finished example exchange before the real question; in the reasoning
    format (`think`) the response to write starts with the opened block (:data:`THINK_PREFIX`).

    Small instruction models follow an output format far more reliably after one worked example.
    """
    msgs: Messages = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs += [{"role": "user", "content": demo_user},
             {"role": "assistant", "content": demo_assistant},
             {"role": "user", "content": user}]
    if think:
        msgs.append({"role": "assistant", "content": THINK_PREFIX})
    return msgs


def draw_distinct(make: Callable[[random.Random], tuple[str, Any]], split: Split, size: int,
                  rng: random.Random, eval_fraction: float = 0.2,
                  exclude: frozenset[str] = frozenset(), what: str = "items") -> list[Any]:
    """Draw `size` distinct items of `split` from a generator of `(canonical key, item)` pairs.

    An item belongs to the split that :func:`split_of` assigns to its key, so train and eval are
    disjoint whatever the seed or size; keys in `exclude` (e.g. the prompt's worked example) are
    never drawn. Raises :class:`TaskSizeError` when the generator's space is too small.
    """
    out: list[Any] = []
    seen: set[str] = set()
    misses = 0  # consecutive draws that gave nothing new: the space is exhausted when this grows
    while len(out) < size:
        if misses >= 5000:
            raise TaskSizeError(
                f"only {len(out)} distinct {split} {what} found, {size} requested: the task's "
                "item space is too small for this size; lower the size or widen the parameters")
        key, item = make(rng)
        if key in seen or key in exclude or split_of(key, eval_fraction) != split:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        out.append(item)
    return out


class TaskSizeError(UserError):
    """More items were requested than a task's parameters can produce."""
