"""The run directory: what identifies a run, refusing a folder that holds another, checkpoints.

`run.json` holds the identity (suite hash, method and config, model, seed); a fresh run needs an
empty folder and `--resume` needs this very run, so results are never overwritten by another.
`checkpoints/stage{t}/` holds the student, the method's state and the RNG states of the last
stage done, written into a temp folder and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.atomic import atomic_dir
from clbench.errors import UserError
from clbench.results import RESULTS_FILENAME, RunResult, read_results
from clbench.seeding import rng_states
from clbench.specs import RunSpec

if TYPE_CHECKING:
    from clbench.engine.api import Method

IDENTITY_FILE = "run.json"


class RunDirError(UserError):
    """The run directory holds something this run must not overwrite."""


# ---------------------------------------------------------------------------------------------
# Run directory: identity and refusal
# ---------------------------------------------------------------------------------------------

def run_identity(run: RunSpec, method_config: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs the same run: suite content, method and config, model, seed."""
    return {"suite": run.suite.name, "suite_hash": run.suite.content_hash(),
            "method": run.method.name, "method_config": method_config,
            "model": run.model.model_dump(mode="json"), "seed": run.seed}


def check_run_dir(run_dir: Path, identity: dict[str, Any], resume: bool) -> RunResult | None:
    """Refuse a directory of another run; return the existing result when resuming.

    Fresh start: the directory must be absent or empty. Resume: it must hold this very run
    (same suite hash, method config, model and seed) or be empty.
    """
    id_file = run_dir / IDENTITY_FILE
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    if not id_file.is_file():
        raise RunDirError(f"{run_dir} is not empty and holds no clbench run ({IDENTITY_FILE} "
                          "missing); choose another --out")
    found = json.loads(id_file.read_text(encoding="utf-8"))
    diffs = _differences(found, identity)
    if diffs:
        detail = "; ".join(f"{path}: {_short(there)} there, {_short(now)} now"
                           for path, there, now in diffs[:4])
        more = f" and {len(diffs) - 4} more" if len(diffs) > 4 else ""
        raise RunDirError(f"{run_dir} holds another run ({detail}{more}); choose another --out")
    if not resume:
        raise RunDirError(f"{run_dir} already holds this run; pass --resume to continue it (or "
                          "print its results with `clbench report`), or choose another --out")
    path = run_dir / RESULTS_FILENAME
    return read_results(path) if path.is_file() else None


def _differences(found: Any, wanted: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, value there, value now) of every leaf where `wanted` differs from `found`,
    so a message names `model.mixed_precision`, not the whole model."""
    if isinstance(found, dict) and isinstance(wanted, dict):
        out = []
        for key in wanted.keys() | found.keys():
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(found.get(key, "(absent)"), wanted.get(key, "(absent)"), sub)
        return sorted(out, key=lambda d: d[0])
    return [] if found == wanted else [(path, found, wanted)]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, stage: int, model: Any, method: Method) -> Path:
    """Write `checkpoints/stage{stage}` atomically (:func:`clbench.atomic.atomic_dir`)."""
    import torch
    from safetensors.torch import save_model

    final = run_dir / "checkpoints" / f"stage{stage}"
    with atomic_dir(final) as tmp:
        save_model(model, str(tmp / "student.safetensors"))
        torch.save({"method": method.state_dict(), "rng": rng_states(), "stage": stage},
                   tmp / "state.pt")
    return final


def load_checkpoint(run_dir: Path, stage: int, model: Any, method: Method) -> None:
    """Restore student weights and method state of `stage` (RNGs are re-seeded per stage)."""
    import torch
    from safetensors.torch import load_model

    folder = run_dir / "checkpoints" / f"stage{stage}"
    if not (folder / "state.pt").is_file():
        raise RunDirError(f"{run_dir}: results say stage {stage} is done but its checkpoint "
                          f"{folder} is missing; the run cannot be resumed")
    load_model(model, str(folder / "student.safetensors"), device=str(model.device))
    state = torch.load(folder / "state.pt", map_location=model.device, weights_only=False)
    method.load_state_dict(state["method"])


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for old in (run_dir / "checkpoints").glob("stage*"):
        if old.name != f"stage{keep}":
            shutil.rmtree(old, ignore_errors=True)
