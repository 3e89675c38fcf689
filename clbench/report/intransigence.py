"""Intransigence of continual runs against the joint runs that are their reference.

Intransigence (Chaudhry et al. 2018) asks how much worse a continual learner does on task k right
after learning it than a model trained on all tasks jointly: I_k = a*_k - R[k][k], where a*
comes from joint runs (`clbench run --joint`, :mod:`clbench.run.joint`). `clbench report` and a
sweep pair each run with the joint runs of the same suite content and method setting among
their inputs: a*_k is their mean score on stream column k (over seeds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from clbench.errors import UserError
from clbench.results import RunResult


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
            raise UserError(f"two different joint runs of {j.entry_name()} seed {j.seed} are "
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
    """What a joint run must share with the runs it is the reference of: suite content, method
    and add-ons, their settings and model, as read now (fields added since at what the run
    did)."""
    from clbench.report.comparison import recorded_settings, suite_hash_as_read
    from clbench.run.rundir import model_as_read

    model = model_as_read(r.model.spec)
    config = recorded_settings(r)
    return (suite_hash_as_read(r), r.entry_name(),
            json.dumps(config, sort_keys=True, default=str),
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
        matrix = [[float("nan") if v is None else v for v in row] for row in run.score_matrix()]
        entry = compute_metrics(matrix, [c.model_dump() for c in run.columns],
                                metrics=["intransigence"], joint=a_star)["intransigence"]
        per_stage = entry.get("per_stage")
        run.metrics["intransigence"] = MetricValue(
            value=entry["value"], variant=f"joint reference (n={n})", higher_is_better=False,
            note=entry.get("note"),
            per_stage=None if per_stage is None else [float(v) for v in per_stage])
