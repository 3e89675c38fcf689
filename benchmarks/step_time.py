"""Seconds per optimizer step of each method on the embedded model (docs/methods.md's table).

Every method trains the same stage from the same freshly loaded weights: the starter suite's math
task (2-digit addition), 4 prompts x 4 samples x 48 new tokens per step. The first step is a
warm-up (allocations, lazy imports) and is left out of the mean.

    .venv/bin/python benchmarks/step_time.py                     # all five methods, 4 steps each
    .venv/bin/python benchmarks/step_time.py --methods grpo --steps 3 --dtype float32 --threads 2

Precision as a run has it: `--dtype bfloat16` trains fp32 master weights under bf16 autocast
(`model.mixed_precision: true`, the default); add `--no-mixed` for weights stored in bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clbench.errors import UserError
from clbench.plugins.registry import build_method, build_task
from clbench.spec.schema import Budget, MethodSpec, TaskSpec
from clbench.train.api import StageContext
from clbench.train.distributed import Distributed

TASK = TaskSpec(source="math.arithmetic", params={"digits": 2, "operands": 2, "operators": "+"},
                train_size=64)
PHASES = ("generate", "grade", "score", "backward", "step")


def measure(method_name: str, steps: int, dtype: str, seed: int, device: str = "cpu",
            mixed_precision: bool = True, params: dict | None = None,
            max_new_tokens: int = 48, samples_per_prompt: int = 4,
            load: Callable[[Distributed], tuple[Any, Any]] | None = None) -> dict:
    """Train `steps` steps of one method (its config overridden by `params`); per-step seconds
    and losses, and summed phase times. `load` builds another model than the embedded one."""
    dist = Distributed.create(device, dtype, mixed_precision)
    model, tokenizer = load(dist) if load else dist.load_model("smollm2-135m")
    task = build_task(TASK)
    method = build_method(MethodSpec(name=method_name, params=params or {}))
    budget = Budget(steps=steps, prompts_per_step=4, samples_per_prompt=samples_per_prompt,
                    max_new_tokens=max_new_tokens)
    with tempfile.TemporaryDirectory() as work:
        ctx = StageContext(model=model, tokenizer=tokenizer, task=task,
                           train_examples=task.examples("train", TASK.seed, TASK.train_size),
                           budget=budget, stage_index=1, stage_name="math", seed=seed,
                           device=model.device, work_dir=Path(work), dist=dist)
        started = time.perf_counter()
        report = method.train_stage(ctx)
        total = time.perf_counter() - started
    per_step = [r["seconds"] for r in report.steps]
    timed = per_step[1:] or per_step
    return {"method": method_name, "dtype": dist.precision.label,
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(model.device),
            "seconds_per_step": statistics.mean(timed), "per_step": per_step,
            "losses": [r.get("loss") for r in report.steps],
            "total_seconds": total, "wall_time": report.wall_time,
            "generated_tokens_per_step": report.counters.get("generated_tokens", 0) / steps,
            "teacher_tokens_per_step": report.counters.get("teacher_tokens", 0) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="sft,grpo,sdpo,sdpo-cot,stable-sdpo")
    parser.add_argument("--steps", type=int, default=4, help="steps per method (first is warm-up)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--no-mixed", dest="mixed", action="store_false",
                        help="store the weights in --dtype instead of fp32 under autocast")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.methods.split(","):
        try:
            rows.append(measure(name.strip(), args.steps, args.dtype, args.seed, args.device,
                                args.mixed))
        except UserError as exc:
            rows.append({"method": name, "error": str(exc)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    where = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() \
        else platform.processor() or platform.machine()
    print(f"# {where}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, 4 prompts x 4 samples x 48 tokens")
    print("| method | dtype | s/step | " + " | ".join(PHASES)
          + " | teacher (in backward) | gen tok/step |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 2))
    for row in rows:
        if "error" in row:
            print(f"| {row['method']} | - | error: {row['error']} |")
            continue
        n = len(row["per_step"])
        phases = " | ".join(f"{row['wall_time'].get(p, 0.0) / n:.2f}" for p in PHASES)
        print(f"| {row['method']} | {row['dtype']} | {row['seconds_per_step']:.2f} | {phases} | "
              f"{row['wall_time'].get('teacher_forward', 0.0) / n:.2f} | "
              f"{row['generated_tokens_per_step']:.0f} |")


if __name__ == "__main__":
    main()
