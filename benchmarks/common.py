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

    from clbench.engine.distributed import Distributed
    from clbench.suites import load_suite

    if args.threads:
        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite)
    dist = Distributed.create(args.device, suite.model.dtype, suite.model.mixed_precision)
    model, tokenizer = dist.load_model(suite.model)
    return suite, dist, model, tokenizer
