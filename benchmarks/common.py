"""What the generation and evaluation benchmarks share: a suite's model loaded as a run loads it.

Benchmarks run as scripts (`python benchmarks/NAME.py`), which puts this folder on the import
path: `from common import suite_model`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_machine_options(ap: argparse.ArgumentParser) -> None:
    """`--device` and `--threads`, as every benchmark names them."""
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def suite_model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """`(suite, dist, model, tokenizer)`: the suite of `args.suite`, its model on the run's
    device in the run's precision (`Distributed.load_model`), torch's threads from
    `args.threads` when given."""
    import torch

    from clbench.spec.suites import load_suite
    from clbench.train.distributed import Distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite)
    dist = Distributed.create(args.device, suite.model.dtype, suite.model.mixed_precision)
    model, tokenizer = dist.load_model(suite.model)
    return suite, dist, model, tokenizer


def task_columns(suite: Any, names: str, n: int) -> list[tuple[str, Any, list[Any]]]:
    """`(column, task, its first n eval items)` of each comma-separated task column."""
    from clbench.plugins.registry import build_task

    specs = {s.name: s.task for s in suite.stages} | {p.name: p.task for p in suite.probes
                                                      if p.task is not None}
    out = []
    for column in names.split(","):
        if column not in specs:
            raise SystemExit(f"no task column {column!r} in {suite.name}: {sorted(specs)}")
        task = build_task(specs[column])
        out.append((column, task, task.examples("eval", specs[column].seed, n)))
    return out


def completions(column: str, task: Any, examples: list[Any], generate: Any,
                batch_size: int) -> list[str]:
    """The column's completions as a run makes them (`evaluate_column`: batches of similar
    prompt length), in item order."""
    from clbench.eval.column import evaluate_column

    cell = evaluate_column(column, task, examples, generate, batch_size=batch_size,
                           bootstrap_samples=1)
    return [record.completion for record in cell.records]


def swapped(module: Any, name: str, replacement: Any) -> tuple[Any, Any]:
    """Two selectors for a benchmark's two ways: `module.name` as it is, and replaced."""
    original = getattr(module, name)
    return (lambda: setattr(module, name, original),
            lambda: setattr(module, name, replacement))
