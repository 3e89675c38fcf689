"""A decoding step's attention, as the fused forward computes it and as transformers does
(docs/performance.md, "A decoding forward with fused projections").

One new query a row over a KV cache of `--filled` columns in preallocated buffers of
`--capacity` (SmolLM2-135M's shape by default: 9 query heads over 3 key/value heads of 64):

- **whole buffers** (`clbench.train.fused_forward`): two batched matrix multiplies over the
  buffers in place, the queries of a key/value head packed as its rows, the unfilled columns
  masked;
- **SDPA over the slice**: transformers' `sdpa` attention function (keys and values repeated
  per query head, `scaled_dot_product_attention` under the mask) over the filled columns, as
  its layers call it on a cache.

Milliseconds per call (median of `--repeats` timings of 20 calls), and the largest difference
between the two outputs.

    python benchmarks/decode_attention.py --rows 46 --filled 601 --capacity 664
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[46, 100],
                    help="rows of the batch (default: 46 tool-use rows, 100 math rows)")
    ap.add_argument("--filled", type=int, nargs="+", default=[601, 180],
                    help="filled cache columns, one per --rows")
    ap.add_argument("--capacity", type=int, nargs="+", default=[701, 178 + 64],
                    help="buffer columns, one per --rows (prompt width + new tokens)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if not len(args.rows) == len(args.filled) == len(args.capacity):
        ap.error("--rows, --filled and --capacity take one value per shape")
    if any(f > c for f, c in zip(args.filled, args.capacity)):
        ap.error("--filled must not exceed --capacity")
    return args


def milliseconds(call: Callable[[], Any], repeats: int, calls: int = 20) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1000)
    return statistics.median(times)


def measure(rows: int, filled: int, capacity: int, args: argparse.Namespace
            ) -> tuple[float, float, float]:
    """(whole buffers ms, SDPA over the slice ms, largest difference) for one shape."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from clbench.train.fused_forward import _attention

    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    groups, scaling = args.heads // args.kv_heads, args.dim ** -0.5
    keys = torch.zeros(rows, args.kv_heads, capacity, args.dim, dtype=dtype)
    values = torch.zeros_like(keys)
    for buffer in (keys, values):
        buffer[:, :, :filled] = torch.randn(rows, args.kv_heads, filled, args.dim, generator=gen)
    q = torch.randn(rows, args.heads, 1, args.dim, generator=gen).to(dtype)
    padding = torch.randint(0, max(1, filled // 8), (rows,), generator=gen)  # left padding
    sliced = torch.arange(filled)[None, :] >= padding[:, None]
    whole_mask = torch.zeros(rows, 1, 1, capacity, dtype=torch.bool)
    whole_mask[..., :filled] = sliced[:, None, None, :]

    def whole() -> Any:
        return _attention(q, keys, values, whole_mask, scaling, groups)

    layer = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)

    def sdpa() -> Any:  # transformers' own attention function over the cache's filled slice
        out, _ = sdpa_attention_forward(layer, q, keys[:, :, :filled], values[:, :, :filled],
                                        sliced[:, None, None, :], scaling=scaling)
        return out.reshape(rows, 1, args.heads * args.dim)

    difference = float((whole().float() - sdpa().float()).abs().max())
    return milliseconds(whole, args.repeats), milliseconds(sdpa, args.repeats), difference


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {args.heads} heads over {args.kv_heads} kv heads of {args.dim}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, ms per call, median of {args.repeats}")
    print("| rows | filled / capacity | whole buffers (ms) | SDPA over the slice (ms) | ratio "
          "| max difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows, filled, capacity in zip(args.rows, args.filled, args.capacity):
        ours, theirs, difference = measure(rows, filled, capacity, args)
        print(f"| {rows} | {filled} / {capacity} | {ours:.2f} | {theirs:.2f} | "
              f"{theirs / ours:.2f}x | {difference:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
