"""Experiment trackers (`--report-to tensorboard|wandb|mlflow`), through accelerate's trackers.

The run's accelerator is made with `log_with` (:meth:`clbench.train.distributed.Distributed.create`)
and its files go under the run folder, `<run>/trackers/`; the main process logs:

- the run's config once (suite, its hash, method and its settings, add-ons, model, seed);
- every training step's record under `train/<key>`, at the run's global step (the steps of the
  earlier stages plus this one's), as `run.log` has it;
- every row of R under `R/<column>`, at the global step where its stage ended (row 0 at 0);
- the run's metrics under `metrics/<name>` at the last step.

Weights & Biases logs offline (`WANDB_MODE=offline`, files under the run folder) unless the user
configured it (`WANDB_MODE`, `WANDB_API_KEY`, or a `wandb login` in `~/.netrc`); MLflow logs to
`<run>/trackers/mlruns` unless `MLFLOW_TRACKING_URI` is set. A tracker whose package is missing
is refused before the run starts, with the extra that installs it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.errors import UserError

if TYPE_CHECKING:
    from clbench.spec.schema import RunSpec

#: Each tracker and the package it needs (installed by the extra of the same name).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TRACKERS_FOLDER = "trackers"


def check_trackers(names: Sequence[str]) -> None:
    """Refuse a tracker whose package is not installed, saying what installs it."""
    for name in names:
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise UserError(f"--report-to {name} needs the `{package}` package, which is not "
                            f"installed: pip install 'clbench[{name}]'")


def prepare_environment(names: Sequence[str], run_dir: Path) -> None:
    """Point the trackers that read their settings from the environment at the run folder,
    where the user has not configured them."""
    folder = run_dir / TRACKERS_FOLDER
    if "wandb" in names:
        os.environ.setdefault("WANDB_DIR", str(folder))
        if not _wandb_configured():
            os.environ["WANDB_MODE"] = "offline"
    if "mlflow" in names:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (folder / "mlruns").resolve().as_uri())


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def run_config(run: RunSpec) -> dict[str, Any]:
    """The run's settings as one flat mapping of scalars (what every tracker can store)."""
    config: dict[str, Any] = {"suite": run.suite.name, "suite_version": run.suite.version,
                              "suite_hash": run.suite.content_hash(), "method": run.method.name,
                              "model": run.model.name, "seed": run.seed,
                              "addons": ",".join(a.name for a in run.addons)}
    for prefix, params in [("method", run.method.params),
                           *((f"addon.{a.name}", a.params) for a in run.addons)]:
        for key, value in sorted(params.items()):
            config[f"{prefix}.{key}"] = value if isinstance(value, (bool, int, float, str)) \
                else json.dumps(value, default=str, sort_keys=True)
    return config


class RunTrackers:
    """What a run logs to its trackers, through its accelerator (logging happens on the main
    process only: accelerate's trackers see to it)."""

    def __init__(self, run: RunSpec, accelerator: Any) -> None:
        self.run, self.accelerator = run, accelerator
        budgets = [s.budget.steps for s in run.training_stages()]
        #: the global step at which each stage starts (stage 1 at 0)
        self.offsets = [sum(budgets[:i]) for i in range(len(budgets) + 1)]

    def start(self) -> None:
        run = self.run
        name = f"{run.suite.name}-{run.method.name}-s{run.seed}"
        self.accelerator.init_trackers(name, config=run_config(run), init_kwargs={
            "wandb": {"name": name, "dir": os.environ.get("WANDB_DIR")},
            "mlflow": {"run_name": name}})

    def log_step(self, stage: int, record: dict[str, Any]) -> None:
        """A training step's record (its numbers) at the run's global step."""
        step = self.offsets[stage - 1] + int(record.get("step", 0))
        self._log({f"train/{k}": v for k, v in record.items() if k != "step"}, step)

    def log_row(self, row: int, columns: Sequence[str], scores: Sequence[float | None]) -> None:
        """Row `row` of R at the step where its stage ended."""
        step = self.offsets[min(row, len(self.offsets) - 1)]
        self._log({f"R/{c}": s for c, s in zip(columns, scores)}, step)

    def log_metrics(self, metrics: dict[str, float | None]) -> None:
        self._log({f"metrics/{k}": v for k, v in metrics.items()}, self.offsets[-1])

    def finish(self) -> None:
        self.accelerator.end_training()

    def _log(self, values: dict[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(float(v))}
        if numbers:
            self.accelerator.log(numbers, step=step)
