"""Which way one SDPO step moves the embedded model, by supervision span.

From the same weights and the same rollouts (the starter's math stage: 4 prompts x 4 samples,
sampled at temperature 1), take ONE optimizer step of `sdpo` with each supervision span
(`response`, the reference's; `final_line`, the ablation; `all`, SDPO-CoT's), and for comparison
one step of SFT on the same prompts' reference solutions. After each step, score the reference
solutions of held-out validation items (training-split items never trained on, never evaluation
items): the change in their log-likelihood, in nats per item, for the whole reference and for
its final answer line alone. A step that moves toward correct answers raises both; a span that
teaches "do not box what you computed" lowers them. Repeated over `--batches` batches (run
seeds); the mean and the range over batches are printed as a Markdown table (the one in
docs/methods.md).

    .venv/bin/python benchmarks/supervision_span.py --batches 5 --lr 1e-5
    .venv/bin/python benchmarks/supervision_span.py --set stages[0].task.params.think=false

(In the reasoning format every completion's final line comes after its `</think>`, so there
`response` and `final_line` supervise the same tokens; they differ on plain completions.)

Warm-up is off (`warmup_steps: 0`) so that the one step takes the full lr; the teacher is the
frozen copy of the starting weights, feedback is off, as the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SPANS = ("response", "final_line", "all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="starter", help="suite whose first stage is used")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="suite override KEY=VALUE (repeatable), e.g. "
                    "stages[0].task.params.think=false")
    ap.add_argument("--batches", type=int, default=5, help="batches (run seeds) to average")
    ap.add_argument("--lr", type=float, default=1e-5, help="learning rate of the one step")
    ap.add_argument("--items", type=int, default=64, help="held-out validation items scored")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32"],
                    help="auto: bf16 autocast where the CPU supports it (as runs do)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return ap.parse_args(argv)


def reference_logprobs(model: Any, tok: Any, examples: list, autocast: Any
                       ) -> tuple[list[float], list[float]]:
    """Per item: log P(reference + EOS | prompt), and log P of its final answer line alone."""
    from clbench.tasks.base import continuation
    from clbench.tasks.math.generated import boxed_answer_start
    from clbench.train.logprobs import completion_logprobs
    from clbench.train.rollout import encode_chat
    from clbench_methods.sdpo.supervision import first_answer_token

    prompts = [encode_chat(tok, e.messages) for e in examples]
    texts = [continuation(e) for e in examples]  # after the start of the response in the prompt
    completions = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for t in texts]
    with torch.no_grad(), autocast():
        scored = completion_logprobs(model, prompts, completions)
    whole, final = [], []
    for i, (text, ids) in enumerate(zip(texts, completions)):
        row = scored.logprobs[i, :len(ids)]
        start = first_answer_token(tok, ids, boxed_answer_start(text))
        whole.append(float(row.sum()))
        final.append(float(row[start:].sum()))
    return whole, final


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from clbench.models import cpu_supports_bf16, load_model
    from clbench.plugins.registry import build_task, load_method_class
    from clbench.run.rows import column_items
    from clbench.spec.suites import load_suite
    from clbench.train.api import StageContext

    if args.threads:
        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite, args.sets)
    stage = suite.stages[0]
    task = build_task(stage.task)
    train = task.examples("train", stage.task.seed, stage.task.train_size)
    held_out = column_items(task, stage.task, args.items, "validation")
    base, tok = load_model(suite.model.model_copy(update={"dtype": "float32"}), device="cpu")
    bf16 = args.dtype == "auto" and cpu_supports_bf16()

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    before_whole, before_final = reference_logprobs(base, tok, held_out, autocast)
    budget = stage.budget.model_copy(update={"steps": 1, "lr": args.lr})
    variants = {f"sdpo, supervision: {span}": ("sdpo", {"supervision": span}) for span in SPANS}
    variants["sft on the reference solutions"] = ("sft", {})
    deltas: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(args.batches):
            for name, (method, settings) in variants.items():
                started = time.perf_counter()
                model = copy.deepcopy(base)
                ctx = StageContext(model=model, tokenizer=tok, task=task, train_examples=train,
                                   budget=budget, stage_index=1, stage_name=stage.name,
                                   seed=seed, device=torch.device("cpu"),
                                   work_dir=Path(scratch))
                cls = load_method_class(method)
                with autocast():
                    report = cls({**settings, "warmup_steps": 0}).train_stage(ctx)
                whole, final = reference_logprobs(model, tok, held_out, autocast)
                supervised = report.steps[0].get("supervised_token_fraction", 1.0)
                deltas[name].append((statistics.mean(w - b for w, b in zip(whole, before_whole)),
                                     statistics.mean(f - b for f, b in zip(final, before_final)),
                                     supervised))
                print(f"batch {seed} {name}: {deltas[name][-1][0]:+.3f} nats (reference), "
                      f"{deltas[name][-1][1]:+.3f} (final line); supervised "
                      f"{supervised:.2f}; {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\nOne optimizer step at lr {args.lr:g} from the base weights, {args.batches} batches "
          f"of {budget.prompts_per_step} prompts x {budget.samples_per_prompt} samples "
          f"({suite.name}/{stage.name}); change of log P(reference | prompt) on "
          f"{len(held_out)} validation items, mean over batches [min, max]; precision "
          f"{'bf16 autocast' if bf16 else 'fp32'}.\n")
    print("| step | whole reference (nats/item) | final answer line (nats/item) | "
          "supervised tokens |")
    print("|---|---:|---:|---:|")
    for name, rows in deltas.items():
        cells = []
        for k in (0, 1):
            values = [r[k] for r in rows]
            cells.append(f"{statistics.mean(values):+.3f} [{min(values):+.3f}, "
                         f"{max(values):+.3f}]")
        share = statistics.mean(r[2] for r in rows)
        print(f"| {name} | {cells[0]} | {cells[1]} | {share:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
