"""The joint (multi-task) reference: one model trained on every stream task at once.

Intransigence (Chaudhry et al. 2018) asks how much worse a continual learner does on task k right
after learning it than a model trained on all tasks jointly: I_k = a*_k - R[k][k]. A joint run
(`clbench run --joint`) gives a*: it trains one stage, `joint`, on the union of the stages'
training items in a seeded mixed order, with the stages' steps summed and each item's rollouts
under its own stage's token cap (:func:`clbench.spec.schema.joint_stage`), and evaluates the suite's
usual columns once. Its R has two rows, base and joint; continual metrics do not apply to it.

This module owns the joint run's training task; the intransigence of the runs it is the
reference of is computed at report time (:mod:`clbench.report.intransigence`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from clbench.tasks.base import Example, Grade, Split, TaskSource, seeded_rng

PART_KEY = "joint_part"  # an example's task in the mixture, in its metadata


class MixedTasks(TaskSource):
    """The stages' tasks as one training task: each example is graded (and its answer found)
    by the task it comes from, and its rollouts keep its stage's token cap. Its items are the
    stages' own (:func:`mixed_train_set`); it draws none itself."""

    name = "joint"
    description = "Every stream task at once (the joint reference's training task)."
    domain = "mixed"

    def __init__(self, parts: Sequence[TaskSource],
                 max_new_tokens: Sequence[int] | None = None) -> None:
        super().__init__()
        self.parts = list(parts)
        self.grades_in_parallel = any(p.grades_in_parallel for p in self.parts)  # type: ignore[misc]
        self.caps = None if max_new_tokens is None else list(max_new_tokens)
        if self.caps is not None and len(self.caps) != len(self.parts):
            raise ValueError(f"{len(self.caps)} token caps for {len(self.parts)} tasks")

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        raise TypeError("the joint task draws no items: they are the stages' own "
                        "(clbench.run.joint.mixed_train_set)")

    def _part(self, example: Example) -> TaskSource:
        return self.parts[int(example.metadata[PART_KEY])]

    def grade(self, example: Example, completion: str) -> Grade:
        return self._part(example).grade(example, completion)

    def answer_start_for(self, example: Example) -> Callable[[str], int]:
        return self._part(example).answer_start_for(example)

    def max_new_tokens_for(self, example: Example) -> int | None:
        return None if self.caps is None else self.caps[int(example.metadata[PART_KEY])]

    def answer_start(self, completion: str) -> int:
        raise TypeError("the joint run's task mixes tasks, each with its own answer format: a "
                        "method asks `ctx.task.answer_start_for(example)(completion)`")


def mixed_train_set(train_sets: Sequence[Sequence[Example]], seed: Any) -> list[Example]:
    """Every stage's training items, each marked with its stage (0-based), in one order shuffled
    from `seed` (the data seeds: the same items in the same order for every run seed)."""
    mixed = [dataclasses.replace(e, metadata={**e.metadata, PART_KEY: i})
             for i, items in enumerate(train_sets) for e in items]
    seeded_rng("joint", seed).shuffle(mixed)
    return mixed
