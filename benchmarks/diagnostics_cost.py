"""What the diagnostics after each stage cost on a suite's model, against a run's wall time.

    python benchmarks/diagnostics_cost.py --suite starter --run-dir runs/starter/sdpo/s0

Loads the suite's model as a run does, writes its base weights (once per run), then for each of
`--stages` stages moves every weight a little (as a stage of training would) and measures the
parameter drift against the base and the previous stage exactly as a run does
(`clbench.run.diagnostics.WeightDrift`, the previous stage's weights read from a checkpoint
file). With `--run-dir` (a finished run of the suite) it also times, for each of its rows, the
artifact and collapse reports and the response drift (the moved model against the base weights,
on the run's item records, under the run's precision), and for each stage the distance of its
training prompts to every column's (the sentence model loaded on first use, as in a run).
Prints seconds per part and the total for a run of `--stages` stages, and (`--compare-exact`)
the drift after the last stage computed with exact SVDs against the decompositions a run uses.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import add_machine_options, suite_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="starter")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="a finished run of the suite, for the artifact reports of its rows")
    ap.add_argument("--compare-exact", action="store_true",
                    help="also compute the last stage's drift with exact SVDs and compare")
    add_machine_options(ap)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_model

    from clbench.run.diagnostics import WeightDrift, base_weights_path, keep_base_weights
    from clbench.run.rundir import STUDENT_WEIGHTS

    suite, dist, model, tokenizer = suite_model(args)
    spec = suite.protocol.diagnostics
    parts: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        started = time.perf_counter()
        keep_base_weights(run_dir, model)
        parts.append(("base weights written (once per run)", time.perf_counter() - started))
        drift = WeightDrift(run_dir, spec.weight_drift)
        generator = torch.Generator().manual_seed(0)
        for stage in range(1, args.stages + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4 * torch.randn(p.shape, generator=generator).to(p))
            started = time.perf_counter()
            summary = drift.after_stage(stage, model)
            parts.append((f"weight drift after stage {stage}", time.perf_counter() - started))
            print(f"stage {stage}: NSS vs base {summary['vs_base']['all']['nss']:.3g}, "
                  f"max angle {summary['vs_base']['all']['max_principal_angle']:.3g} deg",
                  flush=True)
            folder = run_dir / "checkpoints" / f"stage{stage}"
            folder.mkdir(parents=True, exist_ok=True)
            save_model(model, str(folder / STUDENT_WEIGHTS))
        if args.compare_exact:
            compare_exact(run_dir, model, drift.settings, summary["vs_base"])
        if args.run_dir is not None:
            parts += row_parts(args.run_dir, base_weights_path(run_dir), suite, dist, model,
                               tokenizer)
    print("\n| part | seconds |\n|---|---:|")
    for name, seconds in parts:
        print(f"| {name} | {seconds:.1f} |")
    print(f"| **all diagnostics of a {args.stages}-stage run** | "
          f"**{sum(s for _, s in parts):.1f}** |")


def row_parts(run_dir: Path, weights: Path, suite: object, dist: object, model: object,
              tokenizer: object) -> list[tuple[str, float]]:
    """Seconds of each row's artifacts, collapse and response drift, and of each stage's
    distance, measured as a run measures them on `run_dir`'s records."""
    from types import SimpleNamespace

    from clbench.results import read_results
    from clbench.run.diagnostics import row_artifacts, row_collapse
    from clbench.run.distance import PromptDistance
    from clbench.run.response_drift import BaseScores, response_drift
    from clbench.run.rows import plan_columns
    from clbench.spec.schema import RunSpec

    spec = suite.protocol.diagnostics  # type: ignore[attr-defined]
    result = read_results(run_dir / "results.json")
    run = RunSpec(suite=suite, method={"name": result.method.name},
                  model=suite.model, out_dir=str(run_dir))  # type: ignore[attr-defined]
    plans, stage_tasks = plan_columns(run)
    ctx = SimpleNamespace(run_dir=run_dir, model=model, tokenizer=tokenizer, plans=plans)
    distance = PromptDistance(plans, spec.distance)
    kept = BaseScores()  # the base side, kept from row to row as in a run
    parts = []
    for row in range(1, len(result.matrix)):
        started = time.perf_counter()
        found = row_artifacts(run_dir, row, plans, spec.artifacts)
        row_collapse(result.columns, result.matrix[row], found, spec.collapse)
        parts.append((f"artifacts and collapse of row {row}", time.perf_counter() - started))
        started = time.perf_counter()
        with dist.autocast():  # type: ignore[attr-defined]
            drift = response_drift(ctx, row, weights, spec.response_drift, kept)
        prompts = sum(c["prompts"] for c in drift["columns"].values())
        parts.append((f"response drift of row {row} ({prompts} prompts, KL "
                      f"{drift.get('kl', float('nan')):.3g})", time.perf_counter() - started))
        stage = suite.stages[row - 1]  # type: ignore[attr-defined]
        train = stage_tasks[row - 1].examples("train", stage.task.seed, stage.task.train_size)
        started = time.perf_counter()
        distance.after_stage(row, train, result)
        parts.append((f"distance of stage {row}", time.perf_counter() - started))
    return parts


def compare_exact(run_dir: Path, model: object, settings: object, randomised: dict) -> None:
    """The last stage's drift against the base with exact SVDs, beside the run's."""
    import dataclasses
    import time

    from safetensors.torch import load_file

    from clbench.metrics.drift import model_drift, weight_matrices
    from clbench.run.diagnostics import base_weights_path

    base = load_file(str(base_weights_path(run_dir)))
    current = weight_matrices(model.named_parameters())  # type: ignore[attr-defined]
    started = time.perf_counter()
    exact = model_drift(base, {n: w.detach().cpu() for n, w in current.items()},
                        dataclasses.replace(settings, exact_limit=10**9))  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    print(f"\nexact SVDs: {seconds:.1f} s\n\n| kind | quantity | exact | randomised |\n"
          "|---|---|---:|---:|")
    for kind, values in exact.items():
        for key in ("nss", "max_principal_angle", "mask_overlap"):
            print(f"| {kind} | {key} | {values[key]:.6g} | {randomised[kind][key]:.6g} |")


if __name__ == "__main__":
    main()
