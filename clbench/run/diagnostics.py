"""Diagnostics after every stage of a run: parameter and response drift, artifacts in the
completions and rollouts, collapse, and the distance of the stage's prompts from each column's.

**Parameter drift** compares the student's 2-D weights after stage t with the base model's and
with those after stage t-1 (:mod:`clbench.metrics.drift`). The base weights are the run's own:
written once, before anything trains, to `checkpoints/base-weights.safetensors` and read tensor
by tensor when compared (disk, not memory); the previous stage's come from its checkpoint, which
is still on disk when stage t has trained (it is pruned once stage t's checkpoint is kept). The
result goes into the stage's report before the report is kept, so a run resumed after the stage
was kept still has it.

**Artifacts** compare each task column's completions in row t with row 0's, item records read
from the run folder (:mod:`clbench.metrics.artifacts`); **collapse** is judged on the row's
stream scores and those reports. With `collapse.stop` a collapsed run ends after that row with
status `collapsed`. **Rollouts** (on-policy methods): the sampler's token entropy, the share of
rollouts that hit the token cap and of repetitive ones, first and last step of the stage, from its
step records.
**Response drift** (:mod:`clbench.run.response_drift`) and **distance**
(:mod:`clbench.run.distance`) have their own modules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.adapters import effective_parameters, scaling_of, stored_weight
from clbench.atomic import os_errors_of
from clbench.eval.records import read_records, records_path
from clbench.metrics.artifacts import artifact_report, collapse_evidence
from clbench.metrics.drift import (
    DriftSettings,
    Profile,
    drift_between,
    profile,
    summarise,
    weight_matrices,
)
from clbench.run.distance import PromptDistance
from clbench.run.response_drift import BaseScores, response_drift
from clbench.run.rundir import STUDENT_WEIGHTS

if TYPE_CHECKING:
    import torch

    from clbench.results import Cell, Column, RunResult
    from clbench.run.context import RunContext
    from clbench.run.rows import ColumnPlan
    from clbench.spec.schema import ArtifactSpec, CollapseSpec, WeightDriftSpec
    from clbench.tasks.base import Example

log = logging.getLogger("clbench.run.diagnostics")

#: The base model's parameters, as the run started (float32).
BASE_WEIGHTS = "base-weights.safetensors"


def base_weights_path(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / BASE_WEIGHTS


def _parameters(model: Any) -> dict[str, torch.Tensor]:
    """The weights as the model computes with them (an adapter merged in), tied ones once."""
    from clbench.train.distributed import unwrap

    return effective_parameters(unwrap(model))


def _matrices(model: Any) -> dict[str, torch.Tensor]:
    return weight_matrices(_parameters(model).items())


def _aliases(model: Any) -> dict[str, list[str]]:
    """Every name of each parameter (tied weights have several; a checkpoint keeps one)."""
    from clbench.train.distributed import unwrap

    names: dict[int, list[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: group for group in names.values() for name in group}


def keep_base_weights(run_dir: Path, model: Any) -> None:
    """Write the base weights once (a resumed run keeps the file it wrote first)."""
    import torch
    from safetensors.torch import save_file

    path = base_weights_path(run_dir)
    if path.is_file():
        return
    tensors = {name: w.detach().to("cpu", torch.float32).contiguous()
               for name, w in _parameters(model).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{BASE_WEIGHTS}.partial")  # a kill leaves no half file
    with os_errors_of(path):
        save_file(tensors, str(partial))
    partial.replace(path)


class WeightDrift:
    """Drift of the student after each stage against the base and the previous stage; the
    profiles (SVDs) of each side are computed once per process and reused."""

    def __init__(self, run_dir: Path, spec: WeightDriftSpec) -> None:
        self.run_dir = run_dir
        self.settings = DriftSettings(k=spec.k, rtol=spec.rtol, mask_fraction=spec.mask_fraction)
        self.profiles: dict[str, dict[str, Profile]] = {}  # weights file -> name -> profile
        self.seconds = 0.0  # of the last measurement

    def _compare(self, path: Path, current: dict[str, torch.Tensor], now: dict[str, Profile],
                 aliases: dict[str, list[str]], scaling: float | None = None
                 ) -> dict[str, dict[str, float]]:
        from safetensors import safe_open

        known = self.profiles.setdefault(str(path), {})
        drifts = {}
        with safe_open(str(path), framework="pt") as before:
            names = set(before.keys())
            for name, w in current.items():
                stored = next((a for a in aliases.get(name, [name]) if a in names), None)
                # an adapted model's checkpoint: the LoRA layer's weight merged from its parts
                w0 = before.get_tensor(stored) if stored is not None else \
                    stored_weight(before.get_tensor, names, name, scaling)
                if w0 is None:
                    continue
                if w0.shape != w.shape:
                    continue
                if name not in known:
                    known[name] = profile(w0, self.settings)
                drifts[name] = drift_between(w0, known[name], w, now[name], self.settings)
        return summarise(drifts)

    def after_stage(self, stage: int, model: Any) -> dict[str, Any]:
        """`{"vs_base": ..., "vs_previous": ...}`, each per layer kind and `all`."""
        import time

        started = time.perf_counter()
        current = {name: w.detach().to("cpu") for name, w in _matrices(model).items()}
        from clbench.train.distributed import unwrap

        aliases = _aliases(model)
        scaling = scaling_of(unwrap(model))
        now = {name: profile(w, self.settings) for name, w in current.items()}
        base = base_weights_path(self.run_dir)
        previous = (self.run_dir / "checkpoints" / f"stage{stage - 1}" / STUDENT_WEIGHTS
                    if stage > 1 else base)
        out: dict[str, Any] = {}
        if base.is_file():  # absent for a run begun before clbench measured drift
            out["vs_base"] = self._compare(base, current, now, aliases)
        if previous == base and "vs_base" in out:  # stage 1: the previous weights are the base
            out["vs_previous"] = out["vs_base"]
        elif previous.is_file():
            out["vs_previous"] = self._compare(previous, current, now, aliases, scaling)
        # the stage's checkpoint, about to be written, holds these very weights: its profiles
        # are the previous stage's at the next stage
        self.profiles = {str(base): self.profiles.get(str(base), {}),
                         str(self.run_dir / "checkpoints" / f"stage{stage}" / STUDENT_WEIGHTS): now}
        out["settings"] = {"k": self.settings.k, "rtol": self.settings.rtol,
                           "mask_fraction": self.settings.mask_fraction,
                           "mask": "Jaccard overlap of the top mask_fraction entries of the "
                                   "rank-k reconstructions"}
        self.seconds = time.perf_counter() - started  # the stage's wall time gets it
        return out


def row_artifacts(run_dir: Path, row: int, plans: Sequence[ColumnPlan], spec: ArtifactSpec
                  ) -> dict[str, dict[str, object]]:
    """Each task column's :func:`~clbench.metrics.artifacts.artifact_report` of `row` against
    row 0 (columns whose records are missing are left out)."""
    out = {}
    for plan in plans:
        if plan.task is None:  # an lm-eval probe: log-likelihoods, no completions of ours
            continue
        try:
            now = read_records(records_path(run_dir, row, plan.name))
            base = read_records(records_path(run_dir, 0, plan.name))
        except (OSError, ValueError):
            continue
        ended = [r.finished for r in now]
        out[plan.name] = artifact_report([r.completion for r in now],
                                         [r.completion for r in base], n=spec.n, top=spec.top,
                                         growth=spec.growth, repeat_limit=spec.repeat_limit,
                                         ended=None if None in ended else ended)
    return out


def row_collapse(columns: Sequence[Column], row: Sequence[Cell | None],
                 artifacts: dict[str, dict[str, object]], spec: CollapseSpec) -> list[str]:
    """Why the row counts as collapsed (empty: it does not)."""
    stream = [None if cell is None else cell.score
              for column, cell in zip(columns, row) if column.kind == "stream"]
    return collapse_evidence(stream, list(artifacts.values()), score_floor=spec.score_floor,
                             degenerate_share=spec.degenerate_share)


def rollout_diagnostics(steps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The sampler's token entropy, the share of rollouts that never ended (hit the token cap)
    and the share that are repetitive, at the stage's first and last step, from the step
    records of an on-policy method (empty for a method that records none of them)."""
    out: dict[str, float] = {}
    for key, name in (("rollout_entropy", "entropy"), ("finished_rate", "never_ended_share"),
                      ("repetitive_rate", "repetitive_share")):
        values = [float(s[key]) for s in steps if isinstance(s.get(key), (int, float))]
        if values:
            first, last = values[0], values[-1]
            if key == "finished_rate":
                first, last = 1 - first, 1 - last
            out[f"{name}_first"], out[f"{name}_last"] = first, last
    return out


@dataclass
class RowMeasures:
    """What the diagnostics of a run's rows keep from one row to the next: the prompt
    distance (its embeddings of the columns' prompts; None when it is off) and the response
    drift's base-model scores."""

    distance: PromptDistance | None
    base_scores: BaseScores = field(default_factory=BaseScores)


def row_diagnostics(ctx: RunContext, stage: int, result: RunResult, found: dict[str, Any],
                    seconds: dict[str, float], train_examples: Sequence[Example] | None,
                    measures: RowMeasures, steps: Sequence[dict[str, Any]]) -> list[str]:
    """Everything measured once the row after `stage` is evaluated (the last of
    `result.matrix`), added to `found` (the seconds each took to `seconds`); the reasons the row
    counts as collapsed (empty: it does not)."""
    import time

    spec = ctx.run.suite.protocol.diagnostics
    rollouts = rollout_diagnostics(steps)
    if rollouts:
        found["rollouts"] = rollouts
    artifacts = row_artifacts(ctx.run_dir, stage, ctx.plans, spec.artifacts) \
        if spec.artifacts.enabled else {}
    if artifacts:
        found["artifacts"] = artifacts
    if spec.response_drift.enabled:
        started = time.perf_counter()
        found["response_drift"] = response_drift(ctx, stage, base_weights_path(ctx.run_dir),
                                                 spec.response_drift, measures.base_scores)
        seconds["response_drift"] = time.perf_counter() - started
    distance = measures.distance
    if distance is not None:
        started = time.perf_counter()
        measured = distance.after_stage(stage, train_examples, result)
        if measured:
            found["distance"] = measured
        seconds["distance"] = time.perf_counter() - started
    reasons = row_collapse(result.columns, result.matrix[stage], artifacts, spec.collapse)
    found["collapse"] = reasons
    if reasons:
        log.warning("row %d looks collapsed: %s", stage, "; ".join(reasons))
    return reasons
