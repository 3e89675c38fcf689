"""Where evaluation's tokens and seconds go, per column (docs/performance.md, "Where evaluation's
time goes"): the first step of making it faster is knowing which lever can pay.

For each task column, its first `--n` evaluation items decoded as a run decodes them (the
suite's greedy decoding and model settings, a run's batches of similar prompt length):

- **tokens**: prompt tokens per item; the **padding share** of the prefilled batches; the
  **common prefix**, the longest token prefix every prompt of the column shares (chat template,
  system prompt, instructions) and its share of all prompt tokens, what a prefix KV cache
  shared by the column would not prefill again; the tokens **in the prefix tree** of the
  column's prompts and of each batch's (`clbench.train.prefix_tree`: each segment that several
  prompts share counted once, what a prefill computes); completion tokens, and how many rows
  ran to the token cap;
- **after the answer**: of the completions graded correct, the tokens decoded after the
  shortest prefix that already grades correct (a stop rule that ended rows there would save
  them; a wrong completion has no such point and is not counted);
- **seconds**: the whole decoding, and of it the prefill (each batch's prompts into its KV cache
  as the decode loop prefills them, timed apart on the same batches), the rest being the
  token-by-token decoding.

    python benchmarks/eval_profile.py starter --columns math,science,tool_use --n 32
    python benchmarks/eval_profile.py starter --n 100 --tokens-only \
        --columns math,science,tool_use,math_ood,science_ood,tool_use_ood

Timings want a quiet machine (two torch processes on two cores slow each other several times);
token counts do not.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from common import add_machine_options, suite_model, task_columns


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite name (e.g. starter) or path to a suite YAML")
    ap.add_argument("--columns", default="math,science,tool_use")
    ap.add_argument("--n", type=int, default=32, help="eval items per column (default 32)")
    ap.add_argument("--json", action="store_true", help="one JSON object per column")
    ap.add_argument("--tokens-only", action="store_true",
                    help="prompt token counts only (no decoding, no timings: seconds)")
    add_machine_options(ap)
    return ap.parse_args(argv)


def common_prefix(rows: list[list[int]]) -> int:
    """The length of the longest token prefix every row shares."""
    if not rows:
        return 0
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows):
            return i
    return n


def tree_tokens(rows: list[list[int]]) -> int:
    """The tokens of the prefix tree of `rows` (token ids) as the decode loop's prefill builds
    it: each shared segment of at least `SHARED_PREFIX_TOKENS` tokens counted once."""
    from clbench.train import decoding
    from clbench.train.prefix_tree import prefix_tree

    return sum(node.length for node in prefix_tree(rows, decoding.SHARED_PREFIX_TOKENS))


def prompt_tokens(prompts: list[list[int]], batches: list[list[int]]) -> dict[str, Any]:
    """A column's prompt token counts: all, padded batches, the common prefix, the trees."""
    real = sum(len(p) for p in prompts)
    padded = sum(len(b) * max(len(prompts[i]) for i in b) for b in batches)
    prefix = common_prefix(prompts)
    in_batch_trees = sum(tree_tokens([prompts[i] for i in b]) for b in batches)
    return {
        "items": len(prompts), "prompt_tokens": real, "prompt_tokens_mean": real / len(prompts),
        "prompt_tokens_max": max(map(len, prompts)), "padding_share": 1 - real / padded,
        "common_prefix_tokens": prefix, "common_prefix_share": prefix * len(prompts) / real,
        "column_tree_tokens": tree_tokens(prompts), "batch_tree_tokens": in_batch_trees,
    }


def prefill_seconds(model: Any, tokenizer: Any, batches: list[list[list[int]]], new_tokens: int,
                    dist: Any) -> float:
    """Seconds to prefill `batches` of prompts (token ids) as the decode loop does: left-padded
    into a cache with room for `new_tokens`, through its forward (the fused one where it
    applies), the prefixes they share as a tree."""
    import torch

    from clbench.train import decoding
    from clbench.train.fused_forward import decoding_forward

    forward = decoding_forward(model, dist.device.type)
    pad, seconds = tokenizer.pad_token_id, 0.0
    for batch in batches:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=dist.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=dist.device)
        cache = decoding.attention_cache(model, capacity=width + new_tokens)
        started = time.perf_counter()
        decoding.prefill(forward, ids, mask, list(range(len(batch))), cache)
        seconds += time.perf_counter() - started
    return seconds


def tokens_after_answer(task: Any, example: Any, ids: list[int], tokenizer: Any) -> int | None:
    """Tokens decoded after the shortest prefix of a correct completion that grades correct
    (binary search over token prefixes: a longer prefix of a correct answer stays correct for
    the starter's graders); None for a completion graded wrong."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if not task.grade(example, full).correct:
        return None
    low, high = 0, len(ids)  # prefix of `high` tokens grades correct
    while low < high:
        mid = (low + high) // 2
        text = tokenizer.decode(ids[:mid], skip_special_tokens=True)
        if task.grade(example, text).correct:
            high = mid
        else:
            low = mid + 1
    return len(ids) - high


def profile_column(column: str, task: Any, examples: list[Any], model: Any, tokenizer: Any,
                   suite: Any, dist: Any, tokens_only: bool = False) -> dict[str, Any]:
    import torch

    from clbench.eval.column import EvalBatching, prompt_chars, run_generate_fn
    from clbench.train.decoding import row_batches
    from clbench.train.rollout import encode_chat

    decoding, settings = suite.protocol.decoding, suite.model

    prompts = [encode_chat(tokenizer, e.messages) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: -prompt_chars(examples[i].messages))
    batching = EvalBatching.of(decoding, settings.eval_batching, dist.device.type)
    calls = [order[s:s + batching.prompts] for s in range(0, len(order), batching.prompts)]
    batches = [call[a:b] for call in calls  # as the generator splits each call
               for a, b in row_batches([len(prompts[i]) + decoding.max_new_tokens for i in call],
                                       batching.prompts, batching.token_budget)]
    tokens = {"column": column, "batch_rows": [len(b) for b in batches],
              **prompt_tokens(prompts, batches)}
    if tokens_only:
        return tokens

    generate, _ = run_generate_fn(model, tokenizer, decoding, settings)
    completions: dict[int, Any] = {}
    with dist.autocast(), torch.no_grad():
        started = time.perf_counter()
        for call in calls:
            for i, c in zip(call, generate([examples[i].messages for i in call])):
                completions[i] = c
        total = time.perf_counter() - started
        prefill = prefill_seconds(model, tokenizer, [[prompts[i] for i in b] for b in batches],
                                  decoding.max_new_tokens, dist)
    ids_of = {i: tokenizer.encode(c.text, add_special_tokens=False) for i, c in completions.items()}
    after = [tokens_after_answer(task, examples[i], ids_of[i], tokenizer) for i in ids_of]
    counted = [a for a in after if a is not None]
    generated = sum(c.tokens for c in completions.values())
    return {
        **tokens, "completion_tokens_mean": generated / len(completions),
        "rows_at_cap": sum(not c.finished for c in completions.values()),
        "correct": len(counted),
        "tokens_after_answer_mean": sum(counted) / len(counted) if counted else None,
        "tokens_after_answer_share": sum(counted) / generated if generated else None,
        "seconds": total, "prefill_seconds": prefill,
        "prefill_share": prefill / total if total else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    suite, dist, model, tokenizer = suite_model(args)
    decoding = suite.protocol.decoding
    print(f"# {suite.model.name}, {dist.precision.label} on {dist.device}, "
          f"{torch.get_num_threads()} threads, batched as a run ({suite.model.eval_batching}), "
          "greedy, "
          f"{decoding.max_new_tokens} new tokens at most, {args.n} items per column")
    for column, task, examples in task_columns(suite, args.columns, args.n):
        row = profile_column(column, task, examples, model, tokenizer, suite, dist,
                             tokens_only=args.tokens_only)
        if args.json:
            print(json.dumps(row))
            continue
        tree = row["column_tree_tokens"]
        prompt = (f"{column}: prompt {row['prompt_tokens_mean']:.0f} tokens (max "
                  f"{row['prompt_tokens_max']}, {row['prompt_tokens']} in all), padding "
                  f"{row['padding_share']:.0%}, common prefix {row['common_prefix_tokens']} tokens "
                  f"({row['common_prefix_share']:.0%} of prompt tokens), in the column's tree "
                  f"{tree} ({tree / row['prompt_tokens']:.0%}), in its batches' trees "
                  f"{row['batch_tree_tokens']} (batches of {row['batch_rows']} rows)")
        if args.tokens_only:
            print(prompt)
            continue
        after = row["tokens_after_answer_mean"]
        print(f"{prompt}; completion {row['completion_tokens_mean']:.0f} tokens, "
              f"{row['rows_at_cap']}/{row['items']} at the cap; after the answer "
              f"{'n/a' if after is None else f'{after:.0f}'} tokens of the {row['correct']} "
              f"correct ({(row['tokens_after_answer_share'] or 0):.0%} of all decoded); "
              f"{row['seconds']:.1f} s, prefill {row['prefill_seconds']:.1f} s "
              f"({(row['prefill_share'] or 0):.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
