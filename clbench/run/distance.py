"""Transfer against distance: how far each stage's training prompts lie from each column's.

For stage t and every task column j: the MMD (:func:`clbench.metrics.distance.mmd`, RBF kernel,
median bandwidth) between the sentence embeddings (:mod:`clbench.eval.embedding`) of the
stage's training prompts and of the column's evaluation prompts, recorded beside the column's
change over the stage, R[t][j] - R[t-1][j]. A report can then plot gain or forgetting against
distance (the paper finds an inverted U). At most `max_prompts` prompts per side (the first
ones: training items are drawn in a seeded order already). Embeddings of a column are computed
once per process; lm-eval probe columns have no prompts of ours and are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clbench.eval.embedding import EMBEDDING_MODEL, embed, prompt_text
from clbench.metrics.distance import mmd

if TYPE_CHECKING:
    import torch

    from clbench.results import RunResult
    from clbench.run.rows import ColumnPlan
    from clbench.spec.schema import DistanceSpec
    from clbench.tasks.base import Example


class PromptDistance:
    """The distances of one run's stages; column embeddings kept between stages."""

    def __init__(self, plans: Sequence[ColumnPlan], spec: DistanceSpec) -> None:
        self.plans = [p for p in plans if p.task is not None]
        self.spec = spec
        self.columns: dict[str, torch.Tensor] = {}

    def _embed(self, examples: Sequence[Example]) -> torch.Tensor:
        return embed([prompt_text(e.messages) for e in examples[:self.spec.max_prompts]])

    def after_stage(self, stage: int, train_examples: Sequence[Example] | None,
                    result: RunResult) -> dict[str, Any]:
        """`{"embedding": ..., "columns": {name: {"mmd": d, "change": R[t][j] - R[t-1][j]}}}`
        for stage `stage`, whose row is the last of `result.matrix`; empty without at least
        two training prompts."""
        if not train_examples or len(train_examples) < 2:
            return {}
        trained = self._embed(train_examples)
        names = [c.name for c in result.columns]
        now, before = result.matrix[stage], result.matrix[stage - 1]
        columns: dict[str, dict[str, float | None]] = {}
        for plan in self.plans:
            if len(plan.examples) < 2:
                continue
            if plan.name not in self.columns:
                self.columns[plan.name] = self._embed(plan.examples)
            j = names.index(plan.name)
            a, b = (None if c is None else c.score for c in (now[j], before[j]))
            change = None if a is None or b is None else a - b
            columns[plan.name] = {"mmd": mmd(trained, self.columns[plan.name]),
                                  "change": change}
        return {"embedding": EMBEDDING_MODEL, "max_prompts": self.spec.max_prompts,
                "columns": columns}
