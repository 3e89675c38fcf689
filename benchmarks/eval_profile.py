"""Where evaluation's tokens and seconds go, per column (docs/performance.md, "Where evaluation's
time goes"): the first step of making it faster is knowing which lever can pay.

For each task column, its first `--n` evaluation items decoded as a run decodes them (the
suite's greedy decoding and batch size, batches of similar prompt length):

- **tokens**: prompt tokens per item; the **padding share** of the prefilled batches; the
  **common prefix**, the longest token prefix every prompt of the column shares (chat template,
  system prompt, instructions) and its share of all prompt tokens, what a prefix KV cache
  shared by the column would not prefill again; completion tokens, and how many rows ran to the
  token cap;
- **after the answer**: of the completions graded correct, the tokens decoded after the
  shortest prefix that already grades correct (a stop rule that ended rows there would save
  them; a wrong completion has no such point and is not counted);
- **seconds**: the whole decoding, and of it the prefill (each batch's prompts through the model
  once, with its KV cache, timed apart on the same batches), the rest being the token-by-token
  decoding.

    python benchmarks/eval_profile.py starter --columns math,science,tool_use --n 32

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
                   decoding: Any, dist: Any) -> dict[str, Any]:
    import torch

    from clbench.eval.column import make_generate_fn, prompt_chars
    from clbench.train.rollout import encode_chat

    prompts = [encode_chat(tokenizer, e.messages) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: -prompt_chars(examples[i].messages))
    batches = [order[s:s + decoding.batch_size]
               for s in range(0, len(order), decoding.batch_size)]
    real = sum(len(p) for p in prompts)
    padded = sum(len(b) * max(len(prompts[i]) for i in b) for b in batches)
    prefix = common_prefix(prompts)

    generate = make_generate_fn(model, tokenizer, decoding, seed=0)
    completions: dict[int, Any] = {}
    with dist.autocast(), torch.no_grad():
        started = time.perf_counter()
        for batch in batches:
            for i, c in zip(batch, generate([examples[i].messages for i in batch])):
                completions[i] = c
        total = time.perf_counter() - started
        pad = tokenizer.pad_token_id
        started = time.perf_counter()
        for batch in batches:  # the same prompts through the model once, left-padded
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch],
                               device=dist.device)
            mask = (torch.arange(width, device=dist.device)[None, :]
                    >= torch.tensor([width - len(prompts[i]) for i in batch],
                                    device=dist.device)[:, None]).long()
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - started
    ids_of = {i: tokenizer.encode(c.text, add_special_tokens=False) for i, c in completions.items()}
    after = [tokens_after_answer(task, examples[i], ids_of[i], tokenizer) for i in ids_of]
    counted = [a for a in after if a is not None]
    generated = sum(c.tokens for c in completions.values())
    return {
        "column": column, "items": len(examples), "batch_size": decoding.batch_size,
        "prompt_tokens_mean": real / len(prompts), "prompt_tokens_max": max(map(len, prompts)),
        "padding_share": 1 - real / padded,
        "common_prefix_tokens": prefix, "common_prefix_share": prefix * len(prompts) / real,
        "completion_tokens_mean": generated / len(completions),
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
          f"{torch.get_num_threads()} threads, batch {decoding.batch_size}, greedy, "
          f"{decoding.max_new_tokens} new tokens at most, {args.n} items per column")
    for column, task, examples in task_columns(suite, args.columns, args.n):
        row = profile_column(column, task, examples, model, tokenizer, decoding, dist)
        if args.json:
            print(json.dumps(row))
            continue
        after = row["tokens_after_answer_mean"]
        print(f"{column}: prompt {row['prompt_tokens_mean']:.0f} tokens (max "
              f"{row['prompt_tokens_max']}), padding {row['padding_share']:.0%}, common prefix "
              f"{row['common_prefix_tokens']} tokens ({row['common_prefix_share']:.0%} of prompt "
              f"tokens); completion {row['completion_tokens_mean']:.0f} tokens, "
              f"{row['rows_at_cap']}/{row['items']} at the cap; after the answer "
              f"{'n/a' if after is None else f'{after:.0f}'} tokens of the {row['correct']} "
              f"correct ({(row['tokens_after_answer_share'] or 0):.0%} of all decoded); "
              f"{row['seconds']:.1f} s, prefill {row['prefill_seconds']:.1f} s "
              f"({(row['prefill_share'] or 0):.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
