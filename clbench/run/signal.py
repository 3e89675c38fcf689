"""`clbench signal`: does a method's training signal point anywhere useful on this model?

Before a grid of runs: from the model at the start of a stage, take `batches` independent
batches of the method's own training step (its items, rollouts, teacher and loss exactly as a
run builds them, add-ons included) and, for each, the gradient of its loss. The update a step
makes is along minus that gradient (its first Adam update along minus its sign, nearly). The
measurement compares them with the gradient of the log-likelihood of the reference answers of
validation items (the training split after the stage's training items, as
`protocol.split: validation` uses them, never evaluation items):

- `alignment`: the cosine between the method's update and the validation log-likelihood's
  gradient on the stage's own task (and `adam_alignment`, of its first Adam update): does a
  step move towards answers that are right on items it did not train on;
- `forgetting_alignment`: the same against each earlier stage's task (negative: the step moves
  away from what was learned);
- `consistency`: the mean cosine between the updates of two different batches (near 1 with
  alignment near 0: a fixed direction unrelated to correctness, which Adam accumulates);
- `token_attribution`, for the SDPO family: the share of the divergence on tokens where teacher
  and student disagree about the most likely token, on answer tokens, on the closing EOS and on
  the rest; `gradient_share`, the norm of the gradient of the loss kept to each kind of token
  (its normaliser unchanged) over the whole loss's; and `alignment_by_kind`, that part's
  update's cosine with the validation direction (does the signal on those tokens alone point
  towards right answers).

Each is a mean over the batches with a bootstrap interval over batches. For a stage after the
first, the earlier stages are trained first, by the method, as in a run (no evaluation).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clbench.errors import UserError
from clbench.plugins import registry
from clbench.run.setup import draw_items, load_model, make_distributed
from clbench.seeding import derive_seed, seed_everything
from clbench.spec.schema import RunSpec
from clbench.tasks.base import Example, TaskSource
from clbench.train.api import Method, StageContext

#: Validation items whose reference answers give the direction to compare with.
DEFAULT_VALIDATION_ITEMS = 24
BOOTSTRAP_SAMPLES = 1000


@dataclass(frozen=True)
class Interval:
    """A mean over batches and its 95% bootstrap interval over batches."""

    mean: float
    low: float
    high: float

    def as_json(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}


@dataclass
class SignalResult:
    """What `clbench signal` measured for one method on one stage."""

    method: str
    stage: str
    batches: int
    validation_items: int
    alignment: Interval
    adam_alignment: Interval
    consistency: Interval
    forgetting_alignment: dict[str, Interval] = field(default_factory=dict)
    per_batch: dict[str, list[float]] = field(default_factory=dict)
    #: Batches whose loss had no gradient at all (every rollout of a group rewarded alike, say):
    #: their cosines are 0.
    silent_batches: int = 0
    #: For a distillation method: the share of its divergence on each kind of token
    #: (`disagree`, `answer`, `eos`, `rest`), over batches.
    token_attribution: dict[str, Interval] = field(default_factory=dict)
    #: For a distillation method: per kind of token, the norm of the gradient of its loss kept
    #: to those tokens over the whole loss's, and the cosine of that part's update with the
    #: validation direction, over the batches with a gradient.
    gradient_share: dict[str, Interval] = field(default_factory=dict)
    alignment_by_kind: dict[str, Interval] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"method": self.method, "stage": self.stage, "batches": self.batches,
                "validation_items": self.validation_items,
                "alignment": self.alignment.as_json(),
                "adam_alignment": self.adam_alignment.as_json(),
                "consistency": self.consistency.as_json(),
                "forgetting_alignment": {k: v.as_json()
                                         for k, v in self.forgetting_alignment.items()},
                "silent_batches": self.silent_batches,
                "token_attribution": {k: v.as_json() for k, v in self.token_attribution.items()},
                "gradient_share": {k: v.as_json() for k, v in self.gradient_share.items()},
                "alignment_by_kind": {k: v.as_json() for k, v in self.alignment_by_kind.items()},
                "per_batch": self.per_batch}


def measure_signal(run: RunSpec, stage: int = 1, batches: int = 5,
                   validation_items: int = DEFAULT_VALIDATION_ITEMS,
                   on_step: Callable[[str], None] = lambda what: None) -> SignalResult:
    """The signal of `run`'s method (with its add-ons) at the start of stage `stage` (1-based)."""
    stages = run.training_stages()
    if not 1 <= stage <= len(stages):
        raise UserError(f"--stage {stage}: the suite has stages 1 to {len(stages)}")
    if batches < 2:
        raise UserError("--batches: at least 2 (consistency compares batches)")
    method = registry.build_method(run.method)
    if type(method).hooks is Method.hooks:
        raise UserError(f"{run.method.name} trains with a stage of its own (train_stage), not "
                        "the shared training loop: its steps cannot be taken one by one")
    addons = registry.build_addons(run.addons)
    dist = make_distributed(run)
    items = draw_items(run)
    on_step("loading the model")
    model, tokenizer = load_model(run, dist)
    with tempfile.TemporaryDirectory(prefix="clbench-signal-") as work:
        setup = _Setup(run, method, addons, dist, items, model, tokenizer, Path(work))
        result = _measure(setup, stage, batches, validation_items, on_step)
    dist.close()
    return result


@dataclass
class _Setup:
    """What the measurement works with: the run, its method and add-ons as built, its
    accelerator, drawn items, model, and a scratch folder for the stages' `work_dir`."""

    run: RunSpec
    method: Method
    addons: Sequence[Any]
    dist: Any
    items: Any
    model: Any
    tokenizer: Any
    work: Path

    def context(self, index: int) -> StageContext:
        """Stage `index`'s context as a run makes it, the RNGs seeded from (run seed, stage)."""
        seed_everything(derive_seed(self.run.seed, index))
        return _context(self, index)


def _measure(setup: _Setup, stage: int, batches: int, validation_items: int,
             on_step: Callable[[str], None]) -> SignalResult:
    run, method, dist, items = setup.run, setup.method, setup.dist, setup.items
    stages = run.training_stages()
    context = setup.context
    for index in range(1, stage):  # the earlier stages, trained as in a run
        on_step(f"training stage {index} ({stages[index - 1].name})")
        method.train_stage(context(index))
    spec = stages[stage - 1]
    ctx = context(stage)
    references = {}
    for index in range(1, stage + 1):
        name = stages[index - 1].name
        on_step(f"reference answers of {name}")
        references[name] = _reference_gradient(
            ctx, _validation_items(items.stage_tasks[index - 1], stages[index - 1],
                                   validation_items), dist)
    from clbench.train.loop import TrainingLoop

    loop = TrainingLoop(ctx, method.config, method.hooks(ctx))  # type: ignore[arg-type]
    for each in loop.all_hooks:
        each.on_stage_start(loop)
    eps = float(getattr(method.config, "adam_eps", 1e-8))
    own = references[spec.name]
    updates, adam, stats = [], [], []
    by_kind: dict[str, list[float]] = {}
    with dist.autocast():
        for b in range(batches):
            on_step(f"batch {b + 1} of {batches}")
            batch, _ = loop.new_batch(b)
            gradient, batch_stats = _loss_gradient(loop, batch)
            stats.append(batch_stats)
            # Adam's first update, m / (sqrt(v) + eps) with both bias-corrected: the
            # gradient's sign where it is not tiny (compared at once, not kept)
            adam.append(_cosine(-gradient / (gradient.abs() + eps), own))
            for key, value in _kind_gradients(loop, batch, batch_stats, gradient, own).items():
                by_kind.setdefault(key, []).append(value)
            updates.append(gradient.neg_())
    per_batch = {"alignment": [_cosine(u, own) for u in updates], "adam_alignment": adam,
                 **by_kind}
    forgetting = {}
    for name, reference in references.items():
        if name != spec.name:
            per_batch[f"forgetting_alignment:{name}"] = [_cosine(u, reference) for u in updates]
            forgetting[name] = _interval(per_batch[f"forgetting_alignment:{name}"])
    pairs = [[_cosine(updates[i], updates[j]) for j in range(len(updates))]
             for i in range(len(updates))]
    return SignalResult(
        method=run.method.name, stage=spec.name, batches=batches,
        validation_items=validation_items,
        alignment=_interval(per_batch["alignment"]),
        adam_alignment=_interval(per_batch["adam_alignment"]),
        consistency=_pairwise_interval(pairs), forgetting_alignment=forgetting,
        per_batch=per_batch, silent_batches=sum(1 for u in updates if not bool(u.any())),
        token_attribution=_attribution(stats),
        gradient_share={k.split(":")[1]: _interval(v) for k, v in by_kind.items()
                        if k.startswith("gradient_share:")},
        alignment_by_kind={k.split(":")[1]: _interval(v) for k, v in by_kind.items()
                           if k.startswith("alignment_by_kind:")})


def _context(setup: _Setup, index: int) -> StageContext:
    run, items = setup.run, setup.items
    spec = run.training_stages()[index - 1]
    work_dir = setup.work / f"stage{index}"
    work_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(model=setup.model, tokenizer=setup.tokenizer,
                        task=items.stage_tasks[index - 1],
                        train_examples=items.train_sets[index - 1], budget=spec.budget,
                        stage_index=index, stage_name=spec.name,
                        seed=derive_seed(run.seed, index), device=setup.dist.device,
                        work_dir=work_dir, dist=setup.dist, generation=run.model.generation,
                        tasks=items.tasks, addons=setup.addons,
                        nonfinite_loss=run.suite.protocol.nonfinite_loss)


def _validation_items(task: TaskSource, spec: Any, n: int) -> list[Example]:
    """The `n` training-split items after the stage's own (what `protocol.split: validation`
    scores): never trained on by the stage, never evaluation items."""
    drawn = task.examples("train", spec.task.seed, spec.task.train_size + n)
    held = drawn[spec.task.train_size:]
    if not held:
        raise UserError(f"stage {spec.name!r}: its task has no training items beyond the "
                        f"{spec.task.train_size} it trains on to validate with")
    return held


def _reference_gradient(ctx: StageContext, examples: Sequence[Example], dist: Any) -> Any:
    """The gradient of the mean log-likelihood of the reference answers (their EOS included)
    of `examples`, flattened: the direction towards answering them as the references do."""
    from clbench.train.logprobs import completion_logprobs
    from clbench.train.losses import token_mean
    from clbench.train.rollout import encode_reference

    model = ctx.train_model
    model.zero_grad(set_to_none=True)
    pairs = [encode_reference(ctx.tokenizer, e, True) for e in examples]
    total = sum(len(r) for _, r in pairs)
    with dist.autocast():
        for start in range(0, len(pairs), 8):
            part = pairs[start:start + 8]
            scored = completion_logprobs(model, [p for p, _ in part], [r for _, r in part],
                                         grad=True)
            token_mean(scored.logprobs, scored.mask, total).backward()
    return _flat_gradient(model)


def _loss_gradient(loop: Any, batch: Any) -> tuple[Any, dict[str, float]]:
    """The gradient of the step's loss on `batch`, as the loop backpropagates it (the
    method's loss and every add-on's term), flattened; and the step's loss statistics."""
    import torch

    loop.train_model.train()
    loop.train_model.zero_grad(set_to_none=True)
    parts = [] if batch.total_tokens == 0 else loop.hooks.micro_batches(batch)
    sums: dict[str, float] = {}
    for part in parts:
        loss, stats = loop.part_loss(batch, part)
        if loss.requires_grad:
            loss.backward()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    loop.train_model.eval()
    gradient = _flat_gradient(loop.train_model)
    if not torch.isfinite(gradient).all():
        raise UserError("the method's loss gave a gradient that is not finite on a batch")
    return gradient, sums


def _kind_gradients(loop: Any, batch: Any, stats: dict[str, float], gradient: Any,
                    own: Any) -> dict[str, float]:
    """For a batch whose loss splits its divergence by kind of token (and has a gradient): each
    kind's gradient norm over the whole one (`gradient_share:<kind>`) and its update's cosine
    with the validation direction (`alignment_by_kind:<kind>`), the loss kept to those tokens
    through the batch's `loss_token_kind`."""
    total = float(gradient.norm())
    kinds = [key[len(ATTRIBUTION_PREFIX):] for key in stats
             if key.startswith(ATTRIBUTION_PREFIX) and key != "divergence_mean"]
    if total == 0 or not kinds or not hasattr(batch, "loss_token_kind"):
        return {}
    measured = {}
    try:
        for kind in kinds:
            batch.loss_token_kind = kind
            part, _ = _loss_gradient(loop, batch)
            measured[f"gradient_share:{kind}"] = float(part.norm()) / total
            measured[f"alignment_by_kind:{kind}"] = _cosine(part.neg_(), own)
    finally:
        batch.loss_token_kind = None
    return measured


#: A distillation method's step statistics that split its divergence by kind of token
#: (`divergence_<kind>`, parts of `divergence_mean`: clbench_methods/sdpo/attribution.py).
ATTRIBUTION_PREFIX = "divergence_"


def _attribution(stats: Sequence[dict[str, float]]) -> dict[str, Interval]:
    """The share of the divergence on each kind of token, over the batches that have one."""
    shares: dict[str, list[float]] = {}
    for batch in stats:
        total = batch.get("divergence_mean", 0.0)
        if total <= 0:
            continue
        for key, value in batch.items():
            if key.startswith(ATTRIBUTION_PREFIX) and key != "divergence_mean":
                shares.setdefault(key[len(ATTRIBUTION_PREFIX):], []).append(value / total)
    return {kind: _interval(values) for kind, values in shares.items()}


def _flat_gradient(model: Any) -> Any:
    import torch

    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
             .flatten().cpu() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def _cosine(a: Any, b: Any) -> float:
    norm = float(a.norm()) * float(b.norm())
    return float(a @ b) / norm if norm > 0 else 0.0


def _interval(values: Sequence[float]) -> Interval:
    rng = random.Random(0)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values)
                   for _ in range(BOOTSTRAP_SAMPLES))
    return Interval(sum(values) / len(values), means[int(0.025 * BOOTSTRAP_SAMPLES)],
                    means[int(0.975 * BOOTSTRAP_SAMPLES) - 1])


def _pairwise_interval(cosines: Sequence[Sequence[float]]) -> Interval:
    """The mean cosine over pairs of distinct batches, with a bootstrap over batches (pairs of
    the same batch drawn twice left out)."""
    n = len(cosines)
    pairs = [cosines[i][j] for i in range(n) for j in range(i + 1, n)]
    rng = random.Random(0)
    means = []
    for _ in range(BOOTSTRAP_SAMPLES):
        drawn = rng.choices(range(n), k=n)
        values = [cosines[i][j] for a, i in enumerate(drawn) for j in drawn[a + 1:] if i != j]
        if values:
            means.append(sum(values) / len(values))
    means.sort()
    return Interval(sum(pairs) / len(pairs), means[int(0.025 * len(means))],
                    means[int(0.975 * len(means)) - 1])


