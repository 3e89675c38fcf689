"""Experience replay: SFT whose steps mix in training items of earlier stages.

The simplest continual-learning baseline that works (e.g. Rolnick et al. 2019, "Experience
Replay for Continual Learning"): keep a small buffer of each finished stage's training items and
let a share of every later step's items come from it, so earlier tasks keep being rehearsed.
After each stage `buffer_per_stage` of its training items (a seeded sample) join the buffer;
in later stages `replay_fraction` of each step's items (rounded, at least one when the buffer is
not empty and the fraction is positive) are drawn from the buffer, the rest are the stage's own
items in SFT's usual order. The buffer is the method's state: it outlives a stage and is
checkpointed with it.

This package is an example of a clbench method plugin: it subclasses the built-in SFT, changes
which items a step trains on (`step_items`) and what happens at a stage's end, and registers
itself through the `clbench.methods` entry point in its pyproject.toml.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, ClassVar

from pydantic import Field

from clbench.api import Example, StageContext, StageReport, StepHooks, TrainingLoop
from clbench_methods.sft import SFT, SFTConfig, SFTHooks


class ReplayConfig(SFTConfig):
    """SFT's settings and the replay buffer's."""

    replay_fraction: float = Field(default=0.25, ge=0.0, lt=1.0, description="Share of each "
                                   "step's items drawn from earlier stages' buffer.")
    buffer_per_stage: int = Field(default=32, ge=1, description="Training items of each "
                                  "finished stage kept in the buffer.")


class ReplaySFT(SFT):
    """SFT with a replay buffer of earlier stages' training items."""

    name: ClassVar[str] = "replay-sft"
    description: ClassVar[str] = ("Replay: SFT whose steps mix in a share of earlier stages' "
                                  "training items")
    Config: ClassVar[type[ReplayConfig]] = ReplayConfig
    config: ReplayConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.buffer: list[Example] = []

    def hooks(self, ctx: StageContext) -> StepHooks:
        return ReplayHooks(self, ctx)

    def replayed(self, step_items: int) -> int:
        """How many of a step's `step_items` come from the buffer."""
        if not self.buffer or self.config.replay_fraction == 0:
            return 0
        return min(step_items - 1, max(1, round(step_items * self.config.replay_fraction)))

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": [dataclasses.asdict(e) for e in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = [Example(**item) for item in state.get("buffer", [])]


class ReplayHooks(SFTHooks):
    """SFT's hooks with a share of each step's items taken from the buffer."""

    method: ReplaySFT

    def step_items(self, loop: TrainingLoop, step: int) -> list[Example]:
        own = super().step_items(loop, step)
        k = self.method.replayed(len(own))
        if k == 0:
            return own
        rng = random.Random(f"replay/{self.ctx.seed}/{step}/{loop.dist.process_index}")
        return own[:len(own) - k] + rng.sample(self.method.buffer, k)

    def step_stats(self, batch: Any) -> dict[str, float]:
        stats = super().step_stats(batch)
        own = len(batch.pairs)
        stats["replayed_fraction"] = self.method.replayed(own) / own
        return stats

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        items = list(self.ctx.train_examples)
        rng = random.Random(f"replay-buffer/{self.ctx.seed}")
        keep = rng.sample(items, min(self.method.config.buffer_per_stage, len(items)))
        self.method.buffer.extend(keep)
        report.extra["replay_buffer_items"] = len(self.method.buffer)
