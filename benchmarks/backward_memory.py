"""Peak memory of one training forward/backward on the embedded model, with and without activation
checkpointing (docs/methods.md, "Activation checkpointing").

The batch is shaped like a starter tool-use step: 16 rollouts, left-padded prompts of about 700
tokens, 64 completion tokens, scored as SDPO scores the student (top-100 distributions, with
grad). Each setting runs in its own process, so each peak is its own (`ru_maxrss`, CPU) or
`max_memory_allocated` (CUDA).

    .venv/bin/python benchmarks/backward_memory.py                  # checkpointing off and on
    .venv/bin/python benchmarks/backward_memory.py --micro-batch 4 --rows 16 --prompt 700
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(rows: int, prompt: int, completion: int, micro_batch: int | None,
            checkpointing: bool, device: str) -> dict:
    import torch

    from clbench.models import load_model
    from clbench.train.logprobs import completion_distributions
    from clbench.train.optim import OptimizerSettings, set_gradient_checkpointing

    model, _ = load_model("smollm2-135m", device=device, dtype="float32")
    set_gradient_checkpointing(model, OptimizerSettings(gradient_checkpointing=checkpointing))
    model.train()
    gen = torch.Generator().manual_seed(0)
    # ragged prompts, so the batch is padded and attention runs with a mask, as in a real step
    prompts = [torch.randint(100, 40000, (prompt - (i % 3) * 20,), generator=gen).tolist()
               for i in range(rows)]
    completions = [torch.randint(100, 40000, (completion,), generator=gen).tolist()
                   for _ in range(rows)]
    step = micro_batch or rows
    started = time.perf_counter()
    for start in range(0, rows, step):
        dists = completion_distributions(model, prompts[start:start + step],
                                         completions[start:start + step], topk=100, grad=True)
        (dists.token_logprobs.sum() + 0.0 * dists.logprobs.sum()).backward()
    seconds = time.perf_counter() - started
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rows": rows, "prompt": prompt, "completion": completion, "micro_batch": micro_batch,
            "checkpointing": checkpointing, "peak_gb": round(peak / 1e9, 1),
            "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=700, help="longest prompt, in tokens")
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["on", "off"], help="one setting, in this process")
    args = parser.parse_args()
    if args.only:
        print(json.dumps(measure(args.rows, args.prompt, args.completion, args.micro_batch,
                                 args.only == "on", args.device)))
        return
    for setting in ("off", "on"):
        command = [sys.executable, __file__, "--only", setting, "--rows", str(args.rows),
                   "--prompt", str(args.prompt), "--completion", str(args.completion),
                   "--device", args.device]
        if args.micro_batch:
            command += ["--micro-batch", str(args.micro_batch)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
