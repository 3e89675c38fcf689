"""Measure the base model's greedy accuracy on every task column of a suite.

The starter suite is only useful when its training columns start inside a band where on-policy
methods get a signal and have room to learn (10-60% for the embedded model). This script
evaluates the suite's model, before any training, on `--n` eval items of every stage and OOD
probe, through the same evaluation path as `clbench run` (clbench.eval.column), and prints a
markdown table (the one in docs/tasks.md).

    python benchmarks/calibrate_tasks.py starter --n 200 --batch-size 16

Columns can be restricted with `--columns math,science`; `--set` overrides suite fields as on
the CLI (e.g. `--set stages[0].task.params.digits=3`) to try difficulty settings. The table
also says which share of completions close a `</think>` reasoning block (the tasks' `think`
format).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

BAND = (0.10, 0.60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite name (e.g. starter) or path to a suite YAML")
    ap.add_argument("--n", type=int, default=200, help="eval items per column (default 200)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="override the suite's evaluation max_new_tokens")
    ap.add_argument("--columns", default=None, help="comma-separated columns to measure")
    ap.add_argument("--model", default=None, help="override the suite's model name")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="suite override KEY=VALUE (repeatable)")
    ap.add_argument("--show", type=int, default=0,
                    help="print this many wrong completions per column")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 avoids thrashing on a shared, busy machine)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write results as JSON")
    return ap.parse_args(argv)


def columns_of(suite: Any) -> list[tuple[str, str, Any]]:
    """(column, role, TaskSpec) for every stage and task probe, in matrix order."""
    cols = [(s.name, "train", s.task) for s in suite.stages]
    cols += [(p.name, p.kind, p.task) for p in suite.probes if p.task is not None]
    return cols


def band_note(role: str, score: float) -> str:
    if role != "train":
        return ""
    return "in band" if BAND[0] <= score <= BAND[1] else "OUT OF BAND"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from clbench.eval.column import make_generate_fn
    from clbench.spec.suites import load_suite
    from clbench.train.distributed import Distributed

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite, args.sets)
    decoding = suite.protocol.decoding.model_copy(update={"batch_size": args.batch_size})
    if args.max_new_tokens:
        decoding = decoding.model_copy(update={"max_new_tokens": args.max_new_tokens})
    wanted = set(args.columns.split(",")) if args.columns else None
    columns = [c for c in columns_of(suite) if wanted is None or c[0] in wanted]
    model_name = args.model or suite.model.name

    t0 = time.time()
    # The precision a run of this suite evaluates in (e.g. fp32 weights under bf16 autocast):
    # bf16 weights alone answer differently.
    dist = Distributed.create(args.device, suite.model.dtype, suite.model.mixed_precision)
    model, tokenizer = dist.load_model(suite.model.model_copy(update={"name": model_name}))
    print(f"loaded {model_name} ({dist.precision.label}, {model.device}) in "
          f"{time.time() - t0:.1f} s", file=sys.stderr)
    generate = make_generate_fn(model, tokenizer, decoding)
    with dist.autocast():
        rows = [measure_column(column, role, task_spec, generate, args)
                for column, role, task_spec in columns]

    print(render_table(rows, model_name, decoding.max_new_tokens, dist.precision.label))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2, default=str)
    out_of_band = [r["column"] for r in rows if r["role"] == "train"
                   and not BAND[0] <= (r["accuracy"] or 0.0) <= BAND[1]]
    return 1 if out_of_band else 0


def measure_column(column: str, role: str, task_spec: Any, generate: Any,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One column's greedy accuracy, its interval and the shares of answer-less and closed-block
    completions (printing `--show` wrong completions)."""
    from clbench.eval.column import evaluate_column
    from clbench.plugins.registry import build_task
    from clbench.tasks.base import THINK_CLOSE, split_response_start

    task = build_task(task_spec, where=f"{column}.task.params")
    examples = task.examples("eval", task_spec.seed, args.n)
    t = time.time()
    cell = evaluate_column(column, task, examples, generate, batch_size=args.batch_size,
                           bootstrap_samples=1000)
    seconds = time.time() - t
    interval = cell.interval or {}
    no_answer = sum(1 for r in cell.records if r.feedback and r.feedback.startswith("No "))
    closed = sum(1 for r in cell.records if THINK_CLOSE in r.completion)
    row = {"column": column, "role": role, "source": task_spec.source,
           "params": task_spec.params, "n": cell.n, "accuracy": cell.score,
           "low": interval.get("low"), "high": interval.get("high"),
           "no_answer": no_answer / max(cell.n, 1),
           "closed_think": closed / max(cell.n, 1), "seconds": seconds}
    print(f"{column}: {cell.score:.3f} over {cell.n} items in {seconds:.0f} s",
          file=sys.stderr)
    wrong = [(ex, r) for ex, r in zip(examples, cell.records) if not r.correct]
    for ex, r in wrong[:args.show]:
        question = split_response_start(ex.messages)[0][-1]["content"]
        print(f"  [{ex.id}] {question[:100]!r}\n    -> {r.completion[:160]!r}"
              f"\n    ({r.feedback})", file=sys.stderr)
    return row


def render_table(rows: list[dict[str, Any]], model_name: str, max_new_tokens: int,
                 precision: str) -> str:
    lines = [(f"Greedy base accuracy of `{model_name}` ({precision}, max_new_tokens "
             f"{max_new_tokens}); "
             "interval: 95% bootstrap over items."), "",
             ("| column | role | source | params | n | accuracy | 95% interval | no answer | "
             "closed </think> | band |"),
             "| --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "defaults"
        interval = (f"{r['low']:.2f}-{r['high']:.2f}" if r["low"] is not None else "-")
        lines.append(f"| {r['column']} | {r['role']} | `{r['source']}` | {params} | {r['n']} | "
                     f"{r['accuracy']:.3f} | {interval} | {r['no_answer']:.2f} | "
                     f"{r['closed_think']:.2f} | {band_note(r['role'], r['accuracy'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
