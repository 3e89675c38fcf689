"""Evaluation speed against lm-eval's HF backend, alternating in one process.

The same model object, the same items (each column's first `--n` evaluation items of the suite,
as chat prompts), the same greedy decoding (the suite's `max_new_tokens`, EOS ends an item), the
same precision: clbench's evaluation as a run evaluates (`clbench.eval.column.run_generate_fn`
under the suite's model settings: by default the weights held in bf16 for greedy decoding and,
on a CPU, batches by tokens; `--clbench-settings master` for the fp32 weights under autocast in
the protocol's batches) against `lm_eval.models.huggingface.HFLM.generate_until` (which sorts its
requests by length itself) at the suite's batch size (`--lmeval-batch-size` for another). Under
mixed precision lm-eval computes in bf16 over the fp32 weights through its
`mixed_precision_dtype` autocast (whose cast cache lasts a `generate` call).

    python benchmarks/vs_lmeval.py starter --columns math,science,tool_use --n 64 --repeats 2

Prints items per second for each (median [min-max] of the repeats), the ratio, and how many
completions are identical. lm-eval receives each prompt as the text clbench's tokenizer call
encodes (chat template applied, generation header included); the script checks that lm-eval
encodes it to the same token ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from common import add_machine_options, completions, suite_model, task_columns


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite name (e.g. starter) or path to a suite YAML")
    ap.add_argument("--columns", default="math,science,tool_use",
                    help="comma-separated task columns (default math,science,tool_use)")
    ap.add_argument("--n", type=int, default=48, help="eval items per column (default 48)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each (default 2)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="the protocol's evaluation batch size (default: the suite's)")
    ap.add_argument("--lmeval-batch-size", type=int, default=None,
                    help="lm-eval's batch size (default: the protocol's)")
    ap.add_argument("--clbench-settings", choices=("run", "master"), default="run",
                    help="run: the suite's eval_weights and eval_batching, as a run evaluates; "
                         "master: fp32 weights under autocast, the protocol's batches")
    add_machine_options(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    suite, dist, model, tokenizer = suite_model(args)
    decoding = suite.protocol.decoding
    if args.batch_size:
        decoding = decoding.model_copy(update={"batch_size": args.batch_size})
    if decoding.temperature != 0:
        print("the suite's evaluation is sampled; lm-eval is compared on greedy decoding",
              file=sys.stderr)
        return 1
    settings = suite.model if args.clbench_settings == "run" else suite.model.model_copy(
        update={"eval_weights": "master", "eval_batching": "suite"})
    ours = ClbenchEval(model, tokenizer, decoding, dist, settings)
    theirs = LmEvalEval(model, tokenizer, decoding, dist, ours.texts,
                        args.lmeval_batch_size or decoding.batch_size)
    print(f"# {suite.model.name}, {dist.precision.label} on {dist.device}, "
          f"{torch.get_num_threads()} threads, greedy, {decoding.max_new_tokens} new tokens at "
          f"most; clbench: eval_weights {settings.eval_weights}, eval_batching "
          f"{settings.eval_batching} ({ours.prompts} prompts a call), lm-eval: batch "
          f"{theirs.batch_size}; median [min-max] of {args.repeats}")
    print("| column | clbench (items/s) | lm-eval HF (items/s) | ratio | identical |")
    print("|---|---:|---:|---:|---|")
    for column, task, items in task_columns(suite, args.columns, args.n):
        prompts = [ex.messages for ex in items]
        check_same_ids(tokenizer, prompts, theirs.lm, ours.texts(prompts))
        rates: dict[str, list[float]] = {"clbench": [], "lm-eval": []}
        outputs: dict[str, list[str]] = {}
        for _ in range(args.repeats):
            for name, way in (("clbench", ours), ("lm-eval", theirs)):
                started = time.perf_counter()
                outputs[name] = way(column, task, items)
                rates[name].append(len(items) / (time.perf_counter() - started))
        same = sum(a == b for a, b in zip(outputs["clbench"], outputs["lm-eval"]))
        ratio = statistics.median(rates["clbench"]) / statistics.median(rates["lm-eval"])
        print(f"| {column} ({len(items)} items) | {cell(rates['clbench'])} | "
              f"{cell(rates['lm-eval'])} | {ratio:.2f}x | {same}/{len(items)} |", flush=True)
    return 0


class ClbenchEval:
    """A column's items through clbench's evaluation (`evaluate_column`: batches of similar
    length, the suite's decoding, the model `settings`) under the run's autocast."""

    def __init__(self, model: Any, tokenizer: Any, decoding: Any, dist: Any,
                 settings: Any) -> None:
        from clbench.eval.column import run_generate_fn

        self.tokenizer, self.decoding, self.dist = tokenizer, decoding, dist
        self.generate, self.prompts = run_generate_fn(model, tokenizer, decoding, settings)

    def texts(self, prompts: list[Any]) -> list[str]:
        """Each prompt as the text clbench encodes."""
        from clbench.train.rollout import chat_prompt_text

        return [chat_prompt_text(self.tokenizer, p) for p in prompts]

    def __call__(self, column: str, task: Any, items: list[Any]) -> list[str]:
        with self.dist.autocast():
            return completions(column, task, items, self.generate, self.prompts)


class LmEvalEval:
    """The same prompts through lm-eval's `HFLM.generate_until`."""

    def __init__(self, model: Any, tokenizer: Any, decoding: Any, dist: Any,
                 texts: Any, batch_size: int) -> None:
        from lm_eval.models.huggingface import HFLM

        mixed = dist.precision.mixed
        self.batch_size = batch_size
        self.lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                       device=str(dist.device), max_gen_toks=decoding.max_new_tokens,
                       mixed_precision_dtype=dist.precision.compute if mixed else None)
        self.decoding, self.texts = decoding, texts

    def __call__(self, column: str, task: Any, items: list[Any]) -> list[str]:
        from lm_eval.api.instance import Instance

        kwargs = {"until": [], "max_gen_toks": self.decoding.max_new_tokens,
                  "do_sample": False, "temperature": 0.0}
        requests = [Instance("generate_until", {}, (text, dict(kwargs)), i)
                    for i, text in enumerate(self.texts([ex.messages for ex in items]))]
        return self.lm.generate_until(requests, disable_tqdm=True)


def check_same_ids(tokenizer: Any, prompts: list[Any], lm: Any, texts: list[str]) -> None:
    """lm-eval must see the prompts clbench sees: the same token ids after its own encoding."""
    from clbench.train.rollout import encode_chat

    for prompt, text in zip(prompts, texts):
        if lm.tok_encode(text) != encode_chat(tokenizer, prompt):
            raise SystemExit("lm-eval encodes a prompt to other token ids than clbench; the "
                             "comparison would not be on the same inputs")


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


if __name__ == "__main__":
    raise SystemExit(main())
