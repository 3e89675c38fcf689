"""The whole run of each method on a suite: wall time, where it goes, peak memory.

    python benchmarks/whole_run.py --suite starter --methods sft,grpo,sdpo,sdpo-cot,stable-sdpo

Runs `clbench run --suite S --method M --seed N` for each method, one after the other (never side
by side: two torch processes on a small machine slow each other several times), each in its own
process, and prints one table row per method: the run's wall time, each row of R (evaluation)
and each stage's training, the training phases summed over the stages, the generated tokens and
the process's peak resident memory. Row and stage times come from the timestamps of the run's
own log (`run.log`); row 0 includes loading the model.

Row 0 (the base model) is the same for every method of a suite: the first run evaluates it and
the later ones take it from a base-row cache private to this benchmark (`OUT/base-rows`), as a
user's second run takes it from theirs. `--fresh-rows` evaluates it in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
# the loggers' names since the layers became folders, and before (logs of older runs)
ROW_LINE = re.compile(r"clbench(?:\.run)?\.rows: row (\d+) column ")
STEP_LINE = re.compile(r"clbench(?:\.run)?\.protocol: stage (\d+) step ")


def log_marks(log: Path) -> tuple[dict[int, float], dict[int, float]]:
    """`(row -> time its last column was written, stage -> time of its last step)` from a
    run's log, as epoch seconds."""
    rows: dict[int, float] = {}
    stages: dict[int, float] = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        for pattern, marks in ((ROW_LINE, rows), (STEP_LINE, stages)):
            hit = pattern.search(line)
            if hit:
                marks[int(hit.group(1))] = datetime.strptime(line[:23], LOG_TIME).timestamp()
    return rows, stages


def split_time(start: float, rows: dict[int, float], stages: dict[int, float]) -> dict[str, float]:
    """Seconds of each row and each stage's training, in run order: row 0 from the start,
    stage k from row k-1's end to its last step, row k from there to its last column."""
    parts: dict[str, float] = {}
    before = start
    for k in range(max(rows, default=-1) + 1):
        if k in stages:
            parts[f"stage {k}"] = stages[k] - before
            before = stages[k]
        if k in rows:
            parts[f"row {k}"] = rows[k] - before
            before = rows[k]
    return parts


def run_method(args: argparse.Namespace, method: str, out: Path, env: dict[str, str]) -> dict:
    """One `clbench run` in a child process: its results, time split and peak memory."""
    run_dir = out / method
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "clbench.cli", "run", "--suite", args.suite, "--method",
               method, "--seed", str(args.seed), "--out", str(run_dir), *args.extra]
    print("$", " ".join(command), flush=True)
    start = time.time()
    with open(out / f"{method}.log", "w", encoding="utf-8") as console:
        child = subprocess.Popen(command, env=env, stdout=console, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.time() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{method}: clbench run exited {child.returncode}; see {console.name}")
    result = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    phases: dict[str, float] = {}
    for stage in result["stages"]:
        for phase, seconds in stage["wall_time"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return {"method": method, "wall": wall, "parts": split_time(start, *log_marks(
        run_dir / "run.log")), "phases": phases, "tokens": result["compute"]["tokens"],
        "peak_rss": usage.ru_maxrss * 1024, "status": result["status"]}


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def table(measured: list[dict]) -> str:
    parts = list(dict.fromkeys(p for m in measured for p in m["parts"]))
    phases = list(dict.fromkeys(p for m in measured for p in m["phases"]))
    head = ["method", "run", *parts, *(f"{p} (all stages)" for p in phases), "generated tokens",
            "peak RSS GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for m in measured:
        cells = [m["method"], minutes(m["wall"]),
                 *(minutes(m["parts"][p]) if p in m["parts"] else "" for p in parts),
                 *(minutes(m["phases"].get(p, 0.0)) for p in phases),
                 f"{m['tokens'].get('generated_tokens', 0):,}", f"{m['peak_rss'] / 2**30:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="starter")
    ap.add_argument("--methods", default="sft,grpo,sdpo,sdpo-cot,stable-sdpo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-whole-run"))
    ap.add_argument("--fresh-rows", action="store_true",
                    help="evaluate row 0 in every run instead of once")
    ap.add_argument("extra", nargs="*", help="more `clbench run` arguments, after --")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    base_rows = args.out / "base-rows"
    shutil.rmtree(base_rows, ignore_errors=True)
    measured = []
    for method in args.methods.split(","):
        if args.fresh_rows:
            shutil.rmtree(base_rows, ignore_errors=True)
        env["CLBENCH_BASE_ROWS"] = str(base_rows)
        measured.append(run_method(args, method, args.out, env))
        print(table(measured[-1:]), flush=True)
    print(f"\n{args.suite}, seed {args.seed}; minutes:seconds (row 0, or stage 1 where row 0 came"
          " from the cache, includes loading the model"
          f"{'' if args.fresh_rows else '; after the first run it comes from the base-row cache'})")
    print(table(measured))


if __name__ == "__main__":
    main()
