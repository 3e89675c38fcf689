"""Peak memory of a training stage with a LoRA adapter against full fine-tuning
(docs/performance.md, "LoRA adapters").

The starter's math stage, trained by a method exactly as a run trains it (its rollouts, frozen
teacher and optimizer), cut to `--steps` steps; each setting in its own process, so each peak is
its own: `ru_maxrss` on the CPU, `max_memory_allocated` on CUDA. Also the trainable parameters
and the seconds the stage took.

    .venv/bin/python benchmarks/adapter_memory.py                       # sdpo: full, then LoRA
    .venv/bin/python benchmarks/adapter_memory.py --method grpo --steps 2 --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(method_name: str, steps: int, adapter: bool, device: str) -> dict:
    import torch

    from clbench.plugins import registry
    from clbench.plugins.runspec import build_run_spec
    from clbench.run.setup import draw_items, load_model, make_distributed
    from clbench.seeding import derive_seed
    from clbench.spec.options import RunOptions
    from clbench.train.api import StageContext

    sets = [f"stages[0].budget.steps={steps}"]
    if adapter:
        sets.append("model.adapter.kind=lora")
    run = build_run_spec(RunOptions(suite="starter", method=method_name, device=device,
                                    sets=sets))
    method = registry.build_method(run.method)
    dist = make_distributed(run)
    items = draw_items(run)
    model, tokenizer = load_model(run, dist)
    spec = run.training_stages()[0]
    with tempfile.TemporaryDirectory() as work:
        ctx = StageContext(model=model, tokenizer=tokenizer, task=items.stage_tasks[0],
                           train_examples=items.train_sets[0], budget=spec.budget, stage_index=1,
                           stage_name=spec.name, seed=derive_seed(run.seed, 1),
                           device=dist.device, work_dir=Path(work), dist=dist,
                           generation=run.model.generation, tasks=items.tasks)
        started = time.perf_counter()
        with dist.autocast():
            method.train_stage(ctx)
        seconds = time.perf_counter() - started
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"method": method_name, "adapter": "lora" if adapter else "none", "steps": steps,
            "trainable_parameters": trainable, "peak_gb": round(peak / 1e9, 2),
            "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="sdpo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["full", "lora"], help="one setting, in this process")
    args = parser.parse_args()
    if args.only:
        print(json.dumps(measure(args.method, args.steps, args.only == "lora", args.device)))
        return
    for setting in ("full", "lora"):
        command = [sys.executable, __file__, "--only", setting, "--method", args.method,
                   "--steps", str(args.steps), "--device", args.device]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
