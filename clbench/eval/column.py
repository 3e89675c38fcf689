"""Evaluation of one column of the accuracy matrix: a task's eval items -> completions -> grades.

The same code path serves every method and every row: the items come from the task source, the
completions from a generation function built with the protocol's decoding (greedy by default),
the grades from the task's own grader. A cell's score is the fraction of items graded correct
(the "accuracy" of the accuracy matrix); the mean reward, the item count and a Wilson interval
over items travel with it, and the per-item records are kept so every number can be traced to
the completions behind it.

lm-eval probes (general ability) are scored by :mod:`clbench.eval.lmeval` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clbench.eval.records import ItemRecord
from clbench.metrics.aggregate import wilson_interval
from clbench.spec.schema import AUTO_BATCH_GROWTH, CPU_BATCH_TOKENS
from clbench.tasks.base import Example, Messages, TaskSource, grade_all

if TYPE_CHECKING:
    from clbench.progress import AnyProgress
    from clbench.spec.schema import DecodingSpec, ModelSpec


@dataclass(frozen=True)
class Completion:
    """A generated completion and what its text alone does not say."""

    text: str
    tokens: int      # generated tokens kept (up to and including the end token)
    finished: bool   # ended (end token or stop string) before the token cap


#: Generates one completion per chat prompt, in order: its text, or a :class:`Completion`
#: (what :func:`make_generate_fn` gives, so records say which responses never ended).
GenerateFn = Callable[[Sequence[Messages]], Sequence["str | Completion"]]


@dataclass
class CellResult:
    """One cell of R: the score and what stands behind it."""

    column: str
    score: float | None                      # fraction correct; None when there are no items
    mean_reward: float | None
    n: int
    interval: dict[str, Any] | None          # Wilson interval of `score` over items
    records: list[ItemRecord] = field(default_factory=list)
    source: str = "task"                     # "task" or "lm_eval"

    def summary(self) -> dict[str, Any]:
        """The cell without its records (what results.json stores)."""
        return {"column": self.column, "score": self.score, "mean_reward": self.mean_reward,
                "n": self.n, "interval": self.interval, "source": self.source}


def evaluate_column(column: str, task: TaskSource, examples: Sequence[Example],
                    generate: GenerateFn, *, batch_size: int, bootstrap_samples: int = 1000,
                    progress: AnyProgress | None = None,
                    description: str | None = None) -> CellResult:
    """Generate a completion for every example in batches (of prompts of similar length),
    grade each, and summarise the cell.

    ``progress`` (what :func:`clbench.progress.run_progress` gives) gets one task advanced per
    batch. Grader exceptions are not swallowed: a grader that raises is a bug in the task source.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    graded: dict[int, ItemRecord] = {}
    bar = progress.add_task(description or f"eval {column}", total=len(examples)) \
        if progress is not None else None
    # Longest prompts first, so a batch holds prompts of similar length (less padding to
    # prefill, and the largest batch comes first); the records keep the items' order.
    order = sorted(range(len(examples)), key=lambda i: -prompt_chars(examples[i].messages))
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        completions = generate([examples[i].messages for i in batch])
        if len(completions) != len(batch):
            raise RuntimeError(f"generator returned {len(completions)} completions for "
                               f"{len(batch)} prompts")
        texts = [c.text if isinstance(c, Completion) else str(c) for c in completions]
        grades = grade_all([(task, examples[i], text) for i, text in zip(batch, texts)])
        for i, completion, text, grade in zip(batch, completions, texts, grades):
            ex = examples[i]
            done = completion if isinstance(completion, Completion) else None
            graded[i] = ItemRecord(ex.id, text, float(grade.reward), bool(grade.correct),
                                   grade.feedback,
                                   tokens=None if done is None else done.tokens,
                                   finished=None if done is None else done.finished)
        if bar is not None:
            assert progress is not None
            progress.advance(bar, len(batch))
    if bar is not None:
        assert progress is not None
        progress.remove_task(bar)
    records = [graded[i] for i in range(len(examples))]
    return summarise_cell(column, records, bootstrap_samples)


def prompt_chars(messages: Messages) -> int:
    """A prompt's length in characters: within a column, a stand-in for its length in tokens."""
    return sum(len(str(m.get("content", ""))) for m in messages)


def summarise_cell(column: str, records: Sequence[ItemRecord], bootstrap_samples: int = 1000
                   ) -> CellResult:
    """Score, mean reward, count and interval of a list of graded items: the Wilson score
    interval of the fraction correct (:func:`clbench.metrics.aggregate.wilson_interval`;
    honest at 0 and 1, where a percentile bootstrap has no width); none when
    `bootstrap_samples` is 0 (the protocol's switch for cell intervals)."""
    n = len(records)
    if n == 0:
        return CellResult(column, None, None, 0, None, [])
    correct = sum(1 for r in records if r.correct)
    interval = wilson_interval(correct, n) if bootstrap_samples > 0 else None
    return CellResult(column, correct / n, sum(r.reward for r in records) / n, n,
                      interval.as_dict() if interval else None, list(records))


@dataclass(frozen=True)
class EvalBatching:
    """How a column's prompts are batched: `prompts` per call of the generation function (and
    per progress step), split by the generator into batches of at most `token_budget` tokens
    (None: batches of `prompts`)."""

    prompts: int
    token_budget: int | None = None

    @classmethod
    def of(cls, decoding: DecodingSpec, mode: str = "suite", device_type: str = "cpu"
           ) -> EvalBatching:
        """`model.eval_batching` on a device: `suite`, the protocol's batch size; `auto`, on a
        CPU, batches by :data:`CPU_BATCH_TOKENS`; elsewhere (not measured) the protocol's."""
        if mode == "auto" and device_type == "cpu":
            return cls(decoding.batch_size * AUTO_BATCH_GROWTH, CPU_BATCH_TOKENS)
        return cls(decoding.batch_size)


def make_generate_fn(model: Any, tokenizer: Any, decoding: DecodingSpec,
                     seed: int = 0, engine: str = "loop", batching: EvalBatching | None = None,
                     weights: str = "master", drafts: int = 0) -> GenerateFn:
    """A generation function for evaluation with the protocol's decoding.

    Prompts go through the engine's generator (the same chat encoding, EOS handling and padding
    as training rollouts), one completion each. Greedy decoding (temperature 0) ignores ``seed``;
    sampled evaluation is seeded so a row is reproducible: the n-th call samples with a seed
    derived from (``seed``, n), so the batches of a column draw different random numbers.
    ``engine``: `ModelSpec.generation` (an engine that only draws training rollouts, `vllm`,
    evaluates with the decode loop: :func:`clbench.train.rollout.evaluation_engine`);
    ``batching``: the generator's batches (default: the protocol's batch size); ``weights``:
    `ModelSpec.eval_weights`, how greedy decoding holds the weights under mixed precision;
    ``drafts``: `ModelSpec.eval_drafts`, prompt-lookup drafts per greedy decoding step.
    """
    import dataclasses
    import itertools

    from clbench.seeding import derive_seed
    from clbench.train.rollout import HFGenerator, SamplingParams, evaluation_engine

    batching = batching or EvalBatching(decoding.batch_size)
    generator = HFGenerator(model, tokenizer, batch_size=batching.prompts,
                            engine=evaluation_engine(engine),
                            token_budget=batching.token_budget, greedy_weights=weights,
                            drafts=drafts)
    params = SamplingParams.from_decoding(decoding, seed=seed)
    calls = itertools.count()

    def generate(prompts: Sequence[Messages]) -> list[Completion]:
        call = dataclasses.replace(params, seed=derive_seed(seed, next(calls)))
        return [Completion(r.text, r.num_tokens, r.finished)
                for r in generator.generate(list(prompts), call)]

    return generate


def run_generate_fn(model: Any, tokenizer: Any, decoding: DecodingSpec, settings: ModelSpec,
                    seed: int = 0) -> tuple[GenerateFn, int]:
    """How a run evaluates a column: the generation function under the run's model settings
    (`generation`, `eval_batching`, `eval_weights`, `eval_drafts`) and the prompts to hand it at
    a time."""
    batching = EvalBatching.of(decoding, settings.eval_batching, model.device.type)
    return make_generate_fn(model, tokenizer, decoding, seed=seed, engine=settings.generation,
                            batching=batching, weights=settings.eval_weights,
                            drafts=settings.eval_drafts), batching.prompts
