"""Greedy generation under mixed precision: each weight cast once per call against once per token.

A run on a CPU with bf16 keeps fp32 weights and computes under bf16 autocast. Autocast casts a
weight every time a forward uses it; generation runs one forward per new token, so without the
cast cache every decoded token re-casts the whole model. `clbench.engine.rollout` keeps the casts
for the length of a generation call (`weights_cast_once`). This script evaluates a suite's
columns both ways, alternating, on the same items and weights, and checks that the completions
are identical:

    python benchmarks/generation_cast.py starter --columns math,tool_use --n 48 --repeats 3

Prints seconds per column for each way (median of the repeats, with min-max) and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite name (e.g. starter) or path to a suite YAML")
    ap.add_argument("--columns", default="math,tool_use", help="comma-separated task columns")
    ap.add_argument("--n", type=int, default=48, help="eval items per column (default 48)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each way (default 3)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from clbench.engine import rollout
    from clbench.engine.distributed import Distributed
    from clbench.evaluation import make_generate_fn
    from clbench.models import load_model
    from clbench.registry import build_task
    from clbench.suites import load_suite

    if args.threads:
        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite)
    dist = Distributed.create(args.device, suite.model.dtype, suite.model.mixed_precision)
    if not dist.precision.mixed:
        print(f"{suite.model.name} runs in {dist.precision.label} here (no autocast): nothing "
              "to compare", file=sys.stderr)
        return 1
    model, tokenizer = load_model(suite.model, device=dist.device, dtype=dist.precision.weights)
    generate = make_generate_fn(model, tokenizer, suite.protocol.decoding)
    specs = {s.name: s.task for s in suite.stages} | {p.name: p.task for p in suite.probes
                                                      if p.task is not None}
    cached = rollout.weights_cast_once
    ways = {"cast once per call": cached,
            "cast per token": lambda _device: contextlib.nullcontext()}
    print(f"# {suite.model.name}, {dist.precision.label} on {dist.device}, "
          f"{torch.get_num_threads()} threads, {args.n} items per column, batch "
          f"{suite.protocol.decoding.batch_size}, {suite.protocol.decoding.max_new_tokens} "
          f"new tokens, median [min-max] of {args.repeats}")
    print("| column | cast once per call (s) | cast per token (s) | ratio | identical |")
    print("|---|---:|---:|---:|---|")
    try:
        with dist.autocast():
            for column in args.columns.split(","):
                spec = specs[column]
                prompts = [ex.messages for ex in build_task(spec).examples("eval", spec.seed,
                                                                            args.n)]
                print(format_row(column, time_ways(ways, rollout, generate, prompts,
                                                   args.repeats)))
    finally:
        rollout.weights_cast_once = cached
    return 0


def time_ways(ways: dict[str, Any], rollout: Any, generate: Any, prompts: list[Any],
              repeats: int) -> dict[str, Any]:
    """Seconds of each way over `repeats` alternating runs, and whether the outputs agree."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    outputs: dict[str, list[str]] = {}
    for _ in range(repeats):
        for name, way in ways.items():
            rollout.weights_cast_once = way
            started = time.perf_counter()
            outputs[name] = generate(prompts)
            seconds[name].append(time.perf_counter() - started)
    return {"seconds": seconds, "identical": len({tuple(o) for o in outputs.values()}) == 1}


def format_row(column: str, result: dict[str, Any]) -> str:
    once, per_token = result["seconds"].values()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    ratio = statistics.median(per_token) / statistics.median(once)
    return (f"| {column} | {cell(once)} | {cell(per_token)} | {ratio:.2f}x | "
            f"{'yes' if result['identical'] else 'NO'} |")


if __name__ == "__main__":
    raise SystemExit(main())
