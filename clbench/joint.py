"""The joint (multi-task) reference: one model trained on every stream task at once.

Intransigence (Chaudhry et al. 2018) asks how much worse a continual learner does on task k right
after learning it than a model trained on all tasks jointly: I_k = a*_k - R[k][k]. A joint run
(`clbench run --joint`) gives a*: it trains one stage, `joint`, on the union of the stages'
training items in a seeded mixed order, with the stages' steps summed and each item's rollouts
under its own stage's token cap (:func:`clbench.specs.joint_stage`), and evaluates the suite's
usual columns once. Its R has two rows, base and joint; continual metrics do not apply to it.

`clbench report` pairs each run with the joint runs of the same suite content and method setting
among its inputs: a*_k is their mean score on stream column k (over seeds), and the run's
intransigence is computed from it (:func:`add_intransigence`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from clbench.errors import UserError
from clbench.tasks.base import Example, Grade, Split, TaskSource, seeded_rng

if TYPE_CHECKING:
    from clbench.results import RunResult

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
        self.caps = None if max_new_tokens is None else list(max_new_tokens)
        if self.caps is not None and len(self.caps) != len(self.parts):
            raise ValueError(f"{len(self.caps)} token caps for {len(self.parts)} tasks")

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        raise TypeError("the joint task draws no items: they are the stages' own "
                        "(clbench.joint.mixed_train_set)")

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


def joint_reference(run: RunResult, joint_runs: Sequence[RunResult]
                    ) -> tuple[list[float], int] | None:
    """a*: the mean score on each stream column over the joint runs that are references of
    `run` (complete joint runs of the same suite content, model and method setting, each read
    as the current schemas and the installed method read it), one per seed, and how many there
    are; None if none. Two different joint runs of one seed are refused."""
    same: dict[int, RunResult] = {}
    for j in joint_runs:
        if not (j.joint and j.status == "complete" and len(j.matrix) == 2
                and _setting(j) == _setting(run)):
            continue
        if j.seed in same and same[j.seed].model_dump() != j.model_dump():
            raise UserError(f"two different joint runs of {j.method.name} seed {j.seed} are "
                            "references of the same runs; name one of them")
        same[j.seed] = j  # the same run found twice counts once
    if not same:
        return None
    stream = [i for i, c in enumerate(run.columns) if c.kind == "stream"]
    scores = [[None if j.matrix[-1][i] is None else j.matrix[-1][i].score for i in stream]
              for j in same.values()]
    return [float("nan") if any(s[k] is None for s in scores) else
            sum(s[k] for s in scores) / len(scores)  # type: ignore[misc]
            for k in range(len(stream))], len(same)


def _setting(r: RunResult) -> tuple[str, str, str, str]:
    """What a joint run must share with the runs it is the reference of: suite content, method,
    method setting and model, as read now (fields added since at what the run did)."""
    from clbench.comparison import suite_hash_as_read
    from clbench.rundir import method_config_as_read, model_as_read

    model = model_as_read(r.model.spec)
    config = method_config_as_read(r.method.name, r.method.config)
    return (suite_hash_as_read(r), r.method.name, json.dumps(config, sort_keys=True, default=str),
            json.dumps(model, sort_keys=True, default=str))


def add_intransigence(found: Sequence[tuple[Any, RunResult]]) -> None:
    """Give every complete continual run among `found` its intransigence against the joint runs
    among `found` that are its references (:func:`joint_reference`); a run without one keeps
    what it has (undefined, with its note)."""
    from clbench.metrics.continual import compute_metrics
    from clbench.results import MetricValue

    joint_runs = [r for _, r in found if r.joint]
    for _, run in found:
        if run.joint or run.status != "complete":
            continue
        reference = joint_reference(run, joint_runs)
        if reference is None:
            continue
        a_star, n = reference
        matrix = [[float("nan") if c is None else c.score for c in row] for row in run.matrix]
        entry = compute_metrics(matrix, [c.model_dump() for c in run.columns],
                                metrics=["intransigence"], joint=a_star)["intransigence"]
        per_stage = entry.get("per_stage")
        run.metrics["intransigence"] = MetricValue(
            value=entry["value"], variant=f"joint reference (n={n})", higher_is_better=False,
            note=entry.get("note"),
            per_stage=None if per_stage is None else [float(v) for v in per_stage])
