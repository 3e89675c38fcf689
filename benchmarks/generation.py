"""Generation speed-ups, each against the way it replaced, alternating in one process.

`--compare cast` (evaluation, greedy): under mixed precision (fp32 weights, bf16 autocast, what a
run uses on a CPU with AVX512-BF16 and on GPUs) autocast casts a weight every time a forward uses
it; generation runs one forward per new token, so without the cast cache every decoded token
re-casts the whole model. `clbench.train.rollout` keeps the casts for one generation call
(`weights_cast_once`). Evaluates the suite's columns both ways on the same items.

`--compare loop`: clbench's decode loop (`clbench.train.decoding`: one prefill per distinct
prompt, ended rows dropped from the batch, stop strings found from the newest tokens) against
transformers' `model.generate` on the same batches. Evaluates the columns (greedy; the suite's
decoding) and generates one step's rollouts of each stage of the same name (its prompts per step x
samples per prompt, its temperature and token cap), both ways.

`--compare engine`: the decode loop against the `static` engine (`model.generation: static`:
transformers' `generate` over a static KV cache, whose decoding step it compiles with CUDA graphs
on a GPU); the same jobs as `--compare loop`. On a GPU the first repeat of the static engine
pays the compilation; the median leaves it out.

`--compare settings` (evaluation, greedy): a run's evaluation under the suite's model settings
(by default `eval_weights: compute`, the weights held in bf16 with no autocast, and
`eval_batching: auto`, batches by tokens on a CPU) against the fp32 weights under autocast in
batches of `protocol.decoding.batch_size`; also counts each way's correct completions, since
both change bf16 rounding. `--compare drafts`: a run's evaluation with prompt-lookup drafts
(`eval_drafts`, `--drafts`, default 4) against without. `--compare prefill`: a run's evaluation
with each batch prefilled in groups of rows within `decoding.PREFILL_TOKENS` tokens against one
prefill forward per batch. `--compare prefix`: a run's evaluation with the leading tokens common
to a batch's prompts prefilled once (`decoding.SHARED_PREFIX_TOKENS`) against with every row.
`--compare forward`: a run's evaluation and one step's rollouts through the fused decoding
forward (`clbench.train.fused_forward`) against transformers' forward. `--compare keys`: one
step's rollouts of each stage named in `--columns` (sampled under autocast from the fp32
weights) with the fused forward's queries and keys cast to bf16 once
(`fused_forward.CAST_KEYS_ONCE`) against fp32 keys that autocast casts at every attention
call. `--compare packed`: a run's evaluation and one step's rollouts with the fused forward's
projections over at most `fused_forward.PACKED_ROWS` rows (decoding steps) multiplying by
weights packed once per call for oneDNN against the plain weights. `--compare batch`: a run's
evaluation in CPU batches of `--tokens` tokens and at most `--growth` times the protocol's
batch size (`clbench.spec.schema.CPU_BATCH_TOKENS`, `AUTO_BATCH_GROWTH`) against the library's
own.

    python benchmarks/generation.py starter --compare cast --columns math,tool_use --n 32
    python benchmarks/generation.py starter --compare settings --n 100 --repeats 1 \
        --columns math,science,tool_use,math_ood,science_ood,tool_use_ood
    python benchmarks/generation.py starter --compare prefill --columns tool_use --n 64
    python benchmarks/generation.py starter --compare prefix --columns math,math_ood --n 100
    python benchmarks/generation.py starter --compare batch --tokens 49152 --columns tool_use
    python benchmarks/generation.py starter --compare loop --columns math,tool_use --n 32
    python benchmarks/generation.py starter --compare engine --device cuda --n 100
    python benchmarks/generation.py starter --compare forward --columns math,tool_use --n 64
    python benchmarks/generation.py starter --compare keys --columns math,science,tool_use
    python benchmarks/generation.py starter --compare packed --n 100 \
        --columns math,science,tool_use,math_ood,science_ood,tool_use_ood

Prints seconds for each way (median [min-max] of the repeats), the ratio, and how many
completions are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any

from common import add_machine_options, completions, suite_model, swapped, task_columns


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite name (e.g. starter) or path to a suite YAML")
    ap.add_argument("--compare", default="cast",
                    choices=("cast", "loop", "engine", "settings", "drafts", "prefill",
                             "prefix", "batch", "forward", "keys", "packed"),
                    help="cast: weight casts in evaluation; loop: clbench's decode loop against "
                         "model.generate in evaluation and rollouts; engine: the decode loop "
                         "against the static-cache engine, the same jobs; settings: evaluation "
                         "under the suite's eval_weights and eval_batching against master "
                         "weights in the protocol's batches; drafts: evaluation with "
                         "prompt-lookup drafts against without; prefill: evaluation with "
                         "batches prefilled in groups of rows against one prefill per batch; "
                         "prefix: evaluation with the prompts' shared prefix prefilled once "
                         "against with every row; batch: evaluation in CPU batches of --tokens "
                         "tokens against the library's batches; forward: evaluation and "
                         "rollouts with the fused decoding forward against transformers' "
                         "forward; keys: rollouts with the fused forward's keys cast to bf16 "
                         "once against cast at every attention call; packed: evaluation and "
                         "rollouts with decoding steps over weights packed for oneDNN against "
                         "the plain weights")
    ap.add_argument("--drafts", type=int, default=4, help="drafts per step for --compare drafts")
    ap.add_argument("--tokens", type=int, default=24_576,
                    help="tokens per CPU evaluation batch for --compare batch")
    ap.add_argument("--growth", type=int, default=None,
                    help="at most this many times the protocol's batch size per call, for "
                         "--compare batch (default: the library's)")
    ap.add_argument("--columns", default="math,tool_use",
                    help="comma-separated task columns (and, for --compare loop, stages)")
    ap.add_argument("--n", type=int, default=48, help="eval items per column (default 48)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each way (default 3)")
    add_machine_options(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    suite, dist, model, tokenizer = suite_model(args)
    if args.compare in ("cast", "keys") and not dist.precision.mixed:
        print(f"{suite.model.name} runs in {dist.precision.label} here (no autocast): no casts "
              "to compare", file=sys.stderr)
        return 1
    compare = {"cast": compare_cast, "loop": compare_loop, "engine": compare_engine,
               "settings": compare_settings, "drafts": compare_drafts,
               "prefill": compare_prefill, "prefix": compare_prefix,
               "batch": compare_batch, "forward": compare_forward,
               "keys": compare_keys, "packed": compare_packed}[args.compare]
    ways, jobs = compare(suite, model, tokenizer, args)
    print(f"# {suite.model.name}, {dist.precision.label} on {dist.device}, "
          f"{torch.get_num_threads()} threads, median [min-max] of {args.repeats}")
    first, second = ways
    print(f"| job | {first} (s) | {second} (s) | ratio | identical |")
    print("|---|---:|---:|---:|---|")
    with dist.autocast():
        for column, generate in jobs:
            print(format_row(column, time_ways(ways, generate, args.repeats)))
    return 0


def compare_cast(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                 ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column with each weight cast once per call / per token."""
    from clbench.train import rollout

    cast_once, cast_per_token = swapped(rollout, "weights_cast_once",
                                        lambda _device: contextlib.nullcontext())
    return {"cast once per call": cast_once, "cast per token": cast_per_token}, \
        eval_jobs(suite, model, tokenizer, args)


def compare_settings(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                     ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's `eval_weights` and `eval_batching`
    / with master weights in the protocol's batches; each job gives (completion, correct)."""
    settings = suite.model
    before = settings.model_copy(update={"eval_weights": "master", "eval_batching": "suite"})
    return settings_jobs(suite, model, tokenizer, args, {
        f"{settings.eval_weights} weights, {settings.eval_batching} batches": settings,
        f"master weights, batches of {suite.protocol.decoding.batch_size}": before})


def compare_drafts(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings with `--drafts`
    prompt-lookup drafts / without."""
    settings = suite.model
    return settings_jobs(suite, model, tokenizer, args, {
        f"{args.drafts} drafts": settings.model_copy(update={"eval_drafts": args.drafts}),
        "no drafts": settings.model_copy(update={"eval_drafts": 0})})


def compare_prefill(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings, each batch prefilled in
    groups of rows / in one forward."""
    from clbench.train import decoding

    grouped, whole = swapped(decoding, "PREFILL_TOKENS", sys.maxsize)
    _, jobs = settings_jobs(suite, model, tokenizer, args, {"suite": suite.model})
    return {f"prefill in groups of {decoding.PREFILL_TOKENS:,} tokens": grouped,
            "one prefill per batch": whole}, jobs


def compare_prefix(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings, the prompts' shared prefix
    prefilled once / with every row."""
    from clbench.train import decoding

    once, every_row = swapped(decoding, "SHARED_PREFIX_TOKENS", sys.maxsize)
    _, jobs = settings_jobs(suite, model, tokenizer, args, {"suite": suite.model})
    return {"shared prefix prefilled once": once, "prefilled with every row": every_row}, jobs


def compare_batch(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                  ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings in CPU batches of
    `--tokens` tokens (and `--growth` times the protocol's batch size) / the library's."""
    from clbench.eval import column

    growth = args.growth or column.AUTO_BATCH_GROWTH
    library_tokens, other_tokens = swapped(column, "CPU_BATCH_TOKENS", args.tokens)
    library_growth, other_growth = swapped(column, "AUTO_BATCH_GROWTH", growth)
    _, jobs = settings_jobs(suite, model, tokenizer, args, {"suite": suite.model})
    return {f"{column.CPU_BATCH_TOKENS:,} tokens, x{column.AUTO_BATCH_GROWTH} (library)":
            lambda: (library_tokens(), library_growth()),
            f"{args.tokens:,} tokens, x{growth}": lambda: (other_tokens(), other_growth())}, jobs


def compare_forward(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings, and one step's rollouts of
    each stage named in `--columns`, through the fused decoding forward / transformers'."""
    from clbench.train import fused_forward

    fused, theirs = swapped(fused_forward, "FUSED_MODEL_TYPES", ())
    return {"fused forward": fused, "transformers' forward": theirs}, \
        eval_and_rollout_jobs(suite, model, tokenizer, args)


def compare_keys(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                 ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """One step's rollouts of each stage named in `--columns`, queries and keys cast to the
    compute dtype once / fp32 keys cast by autocast at every attention call."""
    from clbench.train import fused_forward

    once, every_call = swapped(fused_forward, "CAST_KEYS_ONCE", False)
    return {"keys cast once": once, "keys cast at every call": every_call}, \
        rollout_jobs(suite, model, tokenizer, args)


def compare_packed(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Greedy evaluation of each column under the suite's settings, and one step's rollouts of
    each stage named in `--columns`, the fused forward's decoding steps over weights packed
    for oneDNN (`fused_forward.PACKED_ROWS`) / over the plain weights."""
    from clbench.train import fused_forward

    packed, plain = swapped(fused_forward, "PACKED_ROWS", 0)
    return {"packed weights": packed, "plain weights": plain}, \
        eval_and_rollout_jobs(suite, model, tokenizer, args)


def eval_and_rollout_jobs(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                          ) -> list[tuple[str, Any]]:
    """Greedy evaluation of each column under the suite's settings, then one step's rollouts
    of each stage named in `--columns`: the jobs of a change to the decoding forward."""
    _, jobs = settings_jobs(suite, model, tokenizer, args, {"suite": suite.model})
    return jobs + rollout_jobs(suite, model, tokenizer, args)


def rollout_jobs(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                 ) -> list[tuple[str, Any]]:
    """One step's rollouts of each stage named in `--columns`, as training samples them."""
    from clbench.train.rollout import HFGenerator

    jobs = []
    for name, prompts, params in rollout_inputs(suite, args):
        generator = HFGenerator(model, tokenizer, batch_size=len(prompts) * params.n)
        jobs.append((name, lambda prompts=prompts, params=params, generator=generator:
                     [r.text for r in generator.generate(prompts, params)]))
    return jobs


def settings_jobs(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace,
                  ways: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Two ways (model settings by name) of evaluating each column as a run does; each job
    gives (completion, correct) per item."""
    from clbench.eval.column import evaluate_column, run_generate_fn

    decoding = suite.protocol.decoding
    chosen = {"settings": next(iter(ways.values()))}

    def job(column: str, task: Any, items: list[Any]) -> list[tuple[str, bool]]:
        generate, prompts = run_generate_fn(model, tokenizer, decoding, chosen["settings"])
        cell = evaluate_column(column, task, items, generate, batch_size=prompts,
                               bootstrap_samples=1)
        return [(record.completion, record.correct) for record in cell.records]

    selectors = {name: (lambda s=s: chosen.update(settings=s)) for name, s in ways.items()}
    jobs = [(f"eval {column} ({len(items)} items)",
             lambda column=column, task=task, items=items: job(column, task, items))
            for column, task, items in task_columns(suite, args.columns, args.n)]
    return selectors, jobs


def eval_jobs(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace,
              generate: Any = None) -> list[tuple[str, Any]]:
    """Each column's first `--n` eval items, evaluated as a run evaluates them (with
    `generate`, by default the run's)."""
    from clbench.eval.column import make_generate_fn

    decoding = suite.protocol.decoding
    generate = generate or make_generate_fn(model, tokenizer, decoding)
    return [(f"eval {column} ({len(items)} items)",
             lambda column=column, task=task, items=items: completions(
                 column, task, items, generate, decoding.batch_size))
            for column, task, items in task_columns(suite, args.columns, args.n)]


def compare_loop(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                 ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Evaluation and one step's rollouts with clbench's decode loop / `model.generate`."""
    from clbench.train import decoding
    from clbench.train.rollout import HFGenerator

    # without a cache the generator can run, it falls back to `model.generate`
    decode_loop, model_generate = swapped(decoding, "attention_cache", lambda _model, **_: None)
    jobs = eval_jobs(suite, model, tokenizer, args)
    for name, prompts, params in rollout_inputs(suite, args):
        generator = HFGenerator(model, tokenizer, batch_size=len(prompts) * params.n)
        jobs.append((name, lambda prompts=prompts, params=params, generator=generator:
                     [r.text for r in generator.generate(prompts, params)]))
    return {"decode loop": decode_loop, "model.generate": model_generate}, jobs


def compare_engine(suite: Any, model: Any, tokenizer: Any, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Evaluation and one step's rollouts with the decode loop / the static-cache engine."""
    from clbench.eval.column import make_generate_fn
    from clbench.train.rollout import GENERATION_ENGINES, HFGenerator

    engine = {"now": "loop"}
    ways = {"decode loop": lambda: engine.update(now="loop"),
            "static cache": lambda: engine.update(now="static")}
    generate = {e: make_generate_fn(model, tokenizer, suite.protocol.decoding, engine=e)
                for e in GENERATION_ENGINES}
    jobs = eval_jobs(suite, model, tokenizer, args,
                     generate=lambda prompts: generate[engine["now"]](prompts))
    for name, prompts, params in rollout_inputs(suite, args):
        generators = {e: HFGenerator(model, tokenizer, batch_size=len(prompts) * params.n,
                                     engine=e) for e in GENERATION_ENGINES}
        jobs.append((name, lambda prompts=prompts, params=params, generators=generators:
                     [r.text for r in generators[engine["now"]].generate(prompts, params)]))
    return ways, jobs


def rollout_inputs(suite: Any, args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """`(job name, prompts, sampling)` of one training step of each stage named in
    `--columns`: its prompts per step, samples per prompt, temperature and token cap."""
    from clbench.plugins.registry import build_task
    from clbench.train.rollout import SamplingParams

    stages = {s.name: s for s in suite.stages}
    out = []
    for column in args.columns.split(","):
        if column not in stages:
            continue
        stage = stages[column]
        budget = stage.budget
        examples = build_task(stage.task).examples("train", stage.task.seed,
                                                   budget.prompts_per_step)
        params = SamplingParams.from_budget(budget, seed=0)
        out.append((f"rollouts {column} ({len(examples)} x {params.n})",
                    [ex.messages for ex in examples], params))
    return out


def time_ways(ways: dict[str, Any], generate: Any, repeats: int) -> dict[str, Any]:
    """Seconds of each way over `repeats` alternating runs, and how many outputs agree."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    outputs: dict[str, list[str]] = {}
    try:
        for _ in range(repeats):
            for name, select in ways.items():
                select()
                started = time.perf_counter()
                outputs[name] = generate()
                seconds[name].append(time.perf_counter() - started)
    finally:
        next(iter(ways.values()))()  # the library's own way again
    first, second = outputs.values()
    result = {"seconds": seconds, "same": sum(a == b for a, b in zip(first, second)),
              "n": len(first)}
    if first and isinstance(first[0], tuple):  # (completion, correct): each way's correct count
        result["correct"] = [sum(c for _, c in out) for out in (first, second)]
    return result


def format_row(column: str, result: dict[str, Any]) -> str:
    ours, theirs = result["seconds"].values()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    ratio = statistics.median(theirs) / statistics.median(ours)
    correct = " (correct {} / {})".format(*result["correct"]) if "correct" in result else ""
    return (f"| {column} | {cell(ours)} | {cell(theirs)} | {ratio:.2f}x | "
            f"{result['same']}/{result['n']}{correct} |")


if __name__ == "__main__":
    raise SystemExit(main())
