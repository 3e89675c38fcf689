"""A trivially learnable toy task and tiny-model helpers, for tests of the engine and methods.

`LowercaseTask`: the prompt asks for lowercase letters; the reward is the fraction of the first
`k` characters of the completion that are lowercase ASCII letters (missing characters count as
wrong, so stopping early does not pay). A randomly initialised char-level model scores about
26/101 by chance, so every batch has reward variance (a learning signal) from step one, and a
method whose loss has the right sign raises the reward within a few dozen steps.

Import from tests as `from toy import ...` (pytest puts `tests/` on the path).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from clbench.models import load_model
from clbench.spec.schema import Budget
from clbench.tasks.base import Example, Grade, Split, TaskParams, TaskSource, seeded_rng
from clbench.train.api import StageContext
from clbench.train.loop import StepBatch, TrainingLoop
from clbench.train.onpolicy import Objective, OnPolicySettings, RolloutBatch
from clbench.train.rollout import Generator, Rollout, SamplingParams


class LowercaseParams(TaskParams):
    k: int = Field(default=8, description="Characters graded.")


class LowercaseTask(TaskSource):
    """Reward = fraction of the first k completion characters that are lowercase letters."""

    name = "toy.lowercase"
    description = "Write lowercase letters (toy task for engine tests)."
    domain = "toy"
    Params = LowercaseParams

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        rng = seeded_rng("toy.lowercase", split, seed)
        items = []
        for i in range(size):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.params.k))
            items.append(Example(
                id=f"{split}-{seed}-{i}",
                messages=[{"role": "user", "content": f"Write {self.params.k} lowercase "
                           f"letters ({split} {i})."}],
                reference=word, answer=self.params.k))
        return items

    def grade(self, example: Example, completion: str) -> Grade:
        head = completion[: self.params.k]
        hits = sum(c in string.ascii_lowercase for c in head)
        reward = hits / self.params.k
        feedback = None if reward == 1 else f"{self.params.k - hits} of the first " \
            f"{self.params.k} characters are not lowercase letters"
        return Grade(reward=reward, correct=reward == 1.0, feedback=feedback)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread, then restore the setting.

    Tiny models gain nothing from intra-op threads, and on a busy machine the threads of
    several processes spin against each other (measured: 9 s vs 110 s for the same 30 steps).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny(name: str = "tiny-llama", seed: int = 0) -> tuple[Any, Any]:
    """A tiny fp32 CPU model and its char tokenizer; the same seed gives the same weights."""
    return load_model(name, device="cpu", dtype="float32", seed=seed)


def toy_context(model: Any, tokenizer: Any, tmp_path: Path, *, steps: int = 30,
                prompts_per_step: int = 4, samples_per_prompt: int = 4, max_new_tokens: int = 8,
                lr: float | None = None, seed: int = 0, train_size: int = 32,
                task: TaskSource | None = None, log: list | None = None,
                dist: Any = None) -> StageContext:
    """A stage context on the toy task with a small budget (`dist`: the run's `Distributed`,
    a one-process one for `model` when not given)."""
    task = task or LowercaseTask({"k": max_new_tokens})
    return StageContext(
        model=model, tokenizer=tokenizer, task=task,
        train_examples=task.examples("train", seed=1234, size=train_size),
        budget=Budget(steps=steps, prompts_per_step=prompts_per_step,
                      samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens,
                      lr=lr),
        stage_index=1, stage_name="toy", seed=seed, device=torch.device("cpu"),
        work_dir=tmp_path, log_step=(log.append if log is not None else (lambda record: None)),
        dist=dist)


class FixedGenerator(Generator):
    """Rollouts that depend on the prompt alone (not on the seed, the rank or the model), of
    uneven lengths (1 to 7 tokens): a step's rows are the same however its prompts are shared
    over processes, and the ranks hold different numbers of tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def generate_from_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams
                          ) -> list[Rollout]:
        out = []
        for p, ids in enumerate(prompt_ids):
            for s in range(params.n):
                length = 1 + (sum(ids) + 2 * s) % 7
                completion = [ids[(j * 5 + s) % len(ids)] for j in range(length)]
                out.append(Rollout(p, s, list(ids), completion,
                                   self.tokenizer.decode(completion), True))
        return out


class RowNLL(Objective):
    """Negative log-likelihood of the completions of the prompts `supervise` picks, a token mean
    over them (over every rank's); micro-batches without such rows give a loss without graph."""

    def __init__(self, ctx: StageContext, supervise: Callable[[Any], bool],
                 config: OnPolicySettings | None = None, **kwargs: Any) -> None:
        super().__init__(ctx, config or OnPolicySettings(lr=1e-3), **kwargs)
        self.supervise = supervise

    def prepare(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        picked = torch.tensor([bool(self.supervise(batch.example_of(i)))
                               for i in range(batch.size)], device=batch.completion_mask.device)
        batch.extra["supervised"] = batch.completion_mask & picked[:, None]
        return {}

    def loss(self, loop: TrainingLoop, batch: StepBatch, rows: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        assert isinstance(batch, RolloutBatch)
        supervised = batch.extra["supervised"][rows.start:rows.stop]
        if not bool(supervised.any()):
            return torch.zeros(()), {}
        scored = batch.score(loop.train_model, rows, grad=True, chunk_size=self.chunk_size)
        return batch.token_mean(-scored.logprobs, supervised), {}

    def supervised_tokens(self, batch: StepBatch) -> int:
        assert isinstance(batch, RolloutBatch)
        return int(batch.extra["supervised"].sum())


def greedy_reward(model: Any, tokenizer: Any, task: TaskSource, n: int = 16) -> float:
    """Mean reward of greedy completions on `n` held-out toy items."""
    from clbench.train.rollout import HFGenerator, SamplingParams

    items = task.examples("eval", seed=99, size=n)
    rollouts = HFGenerator(model, tokenizer, batch_size=n).generate(
        [e.messages for e in items], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    return sum(task.grade(items[r.prompt_index], r.text).reward for r in rollouts) / n
