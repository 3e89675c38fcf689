"""Experience replay: a share of every step's items drawn from earlier stages' items.

The simplest continual-learning baseline that works (Rolnick et al. 2019, "Experience Replay for
Continual Learning"; Chaudhry et al. 2019, "On Tiny Episodic Memories in Continual Learning"):
after each stage `buffer_per_stage` of its training items (a seeded sample) join a buffer; in
later stages `fraction` of each step's items (rounded, at least one when the buffer is not empty
and the fraction is positive, never all of them) are drawn from it in place of the stage's own.
Replayed items are trained on as the method trains on any item: SFT on their reference, an
on-policy method on rollouts graded by their own stage's task. The buffer is the add-on's
state: it outlives a stage and is checkpointed with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import Field

from clbench.api import AddOn, AddOnConfig, Example, StageReport, TrainingLoop, seeded_rng


class ReplayConfig(AddOnConfig):
    """How much of each step is replayed, and how many items of each stage are kept."""

    fraction: float = Field(default=0.25, ge=0.0, lt=1.0, description="Share of each step's "
                            "items drawn from the buffer of earlier stages' items (0: none).")
    buffer_per_stage: int = Field(default=32, ge=1, description="Training items of each "
                                  "finished stage kept in the buffer (a seeded sample).")


class Replay(AddOn):
    """Rehearse earlier stages' items in every step of the later ones."""

    name: ClassVar[str] = "replay"
    description: ClassVar[str] = ("Replay: a share of each step's items from a buffer of "
                                  "earlier stages' items, graded by their own task")
    Config: ClassVar[type[ReplayConfig]] = ReplayConfig
    supports_sharding: ClassVar[bool] = True
    config: ReplayConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.buffer: list[Example] = []
        self.replayed_share = 0.0  # of the last batch's items

    def replayed(self, step_items: int) -> int:
        """How many of a step's `step_items` come from the buffer."""
        if not self.buffer or self.config.fraction == 0 or step_items < 2:
            return 0
        return min(step_items - 1, max(1, round(step_items * self.config.fraction)))

    def choose_examples(self, loop: TrainingLoop, step: int, examples: list[Example]
                        ) -> list[Example]:
        k = self.replayed(len(examples))
        self.replayed_share = k / max(len(examples), 1)
        if k == 0:
            return examples
        rng = seeded_rng("replay", loop.ctx.seed, step)
        drawn = rng.sample(self.buffer, k) if k <= len(self.buffer) else \
            rng.choices(self.buffer, k=k)
        return examples[:len(examples) - k] + drawn

    def after_step(self, loop: TrainingLoop, step: int) -> dict[str, float]:
        return {"replayed_fraction": self.replayed_share}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        items = list(loop.ctx.train_examples)
        rng = seeded_rng("replay-buffer", loop.ctx.seed)
        self.buffer += rng.sample(items, min(self.config.buffer_per_stage, len(items)))
        report.extra["replay_buffer_items"] = len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": [dataclasses.asdict(e) for e in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = [Example(**item) for item in state["buffer"]]
