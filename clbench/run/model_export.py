"""A run's trained model as a Hugging Face model folder, for tools outside clbench.

A run keeps the student of its last trained stage in `checkpoints/stage{t}/` in the form
resuming needs (weights without config or tokenizer, method state, RNG states). Exporting
rebuilds the run's model from its identity, loads those weights and saves config, weights and
tokenizer with `save_pretrained`, so `from_pretrained(folder)` and lm-eval's `hf` model load it,
for instance to score it on a suite exported with `clbench export-lm-eval`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from clbench.adapters import adapter_files, is_adapted, merged_copy
from clbench.atomic import atomic_dir, os_errors_of
from clbench.run.rundir import IDENTITY_FILE, STUDENT_WEIGHTS, RunDirError


def saved_stages(run_dir: Path) -> list[int]:
    """Stages whose student weights are on disk, in order (a run keeps only its last)."""
    found = []
    for folder in (run_dir / "checkpoints").glob("stage*"):
        match = re.fullmatch(r"stage(\d+)", folder.name)
        if match and (folder / STUDENT_WEIGHTS).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def export_model(run_dir: str | Path, out_dir: str | Path, trust_remote_code: bool = False,
                 adapter_only: bool = False) -> tuple[Path, int]:
    """Write the student after the run's last saved stage to `out_dir` (which must be absent
    or empty); returns the folder and the stage. The weights keep the dtype they were trained
    in (fp32 master weights under mixed precision). The model's repository runs its own code
    only with `trust_remote_code` (the command's flag), whatever the run folder recorded: a
    run folder is a file from whoever made it. A run that trained an adapter is written with
    the adapter merged in (a plain model), or with `adapter_only` the adapter alone in peft's
    format."""
    from safetensors import safe_open
    from safetensors.torch import load_model as load_weights

    from clbench.models import load_model
    from clbench.spec.schema import ModelSpec

    run_dir, out = Path(run_dir), Path(out_dir)
    try:
        identity = json.loads((run_dir / IDENTITY_FILE).read_text(encoding="utf-8"))
        spec = ModelSpec.model_validate(identity["model"]).model_copy(
            update={"trust_remote_code": trust_remote_code})
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: not a run folder ({IDENTITY_FILE} missing)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{run_dir / IDENTITY_FILE} is damaged ({exc}); the run's model "
                          "cannot be rebuilt") from None
    stages = saved_stages(run_dir)
    if not stages:
        raise RunDirError(f"{run_dir}: no checkpoint yet (the run has trained no stage)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunDirError(f"{out} exists and is not an empty folder; choose another")
    weights = run_dir / "checkpoints" / f"stage{stages[-1]}" / STUDENT_WEIGHTS
    with safe_open(str(weights), framework="pt") as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()  # e.g. "F32", "BF16"
    torch_dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32")
    model, tokenizer = load_model(spec, device="cpu", dtype=torch_dtype,
                                  seed=int(identity.get("seed", 0)))
    load_weights(model, str(weights), device="cpu")
    if adapter_only and not is_adapted(model):
        raise RunDirError(f"{run_dir}: --adapter-only, but the run trained no adapter "
                          "(model.adapter.kind: none); export the whole model instead")
    with atomic_dir(out) as tmp, os_errors_of(out):
        if adapter_only:
            adapter_files(model, tmp)
        else:
            merged_copy(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out, stages[-1]
