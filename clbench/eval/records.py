"""Per-item evaluation records on disk: one JSONL file per (row, column) of a run folder, the
completions behind every cell, and the few of them a results file carries as `examples`.

Light on purpose (no task or model code): the leaderboard reads records of old run folders.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from clbench.atomic import atomic_write_text
from clbench.results import EXAMPLE_CHARS, EXAMPLES_PER_COLUMN, ExampleCompletion, RunResult


@dataclass(frozen=True)
class ItemRecord:
    """One graded evaluation item: enough to re-check any cell by hand."""

    id: str
    completion: str
    reward: float
    correct: bool
    feedback: str | None = None
    tokens: int | None = None      # completion tokens (None: not known, e.g. lm-eval)
    finished: bool | None = None   # ended before the token cap (None: not known)



def records_path(run_dir: Path, row: int, column: str) -> Path:
    """`<run_dir>/items/row{row}/{column}.jsonl`."""
    return Path(run_dir) / "items" / f"row{row}" / f"{column}.jsonl"


def write_records(path: Path, records: Sequence[ItemRecord]) -> None:
    """Write the records as JSONL atomically (a reader never sees half a file)."""
    atomic_write_text(path, "".join(json.dumps(asdict(rec), ensure_ascii=False) + "\n"
                                    for rec in records))


def example_records(run_dir: Path, row: int, column: str, k: int = 2) -> list[ItemRecord]:
    """Up to `k` of row `row`'s records of `column`, in item order: the first right one and the
    first wrong one where both exist (what a reader of the numbers wants to see); none when
    the row's records are not on disk."""
    path = records_path(run_dir, row, column)
    try:
        records = read_records(path)
    except (OSError, ValueError, TypeError):
        return []
    right = [r for r in records if r.correct][:1]
    wrong = [r for r in records if not r.correct][:1]
    picked = {id(r) for r in right + wrong}
    rest = [r for r in records if id(r) not in picked]
    chosen = {id(r) for r in (right + wrong + rest)[:k]}
    return [r for r in records if id(r) in chosen]


def examples_of(run_dir: Path, result: RunResult) -> dict[str, list[ExampleCompletion]]:
    """The `examples` of a result: per column, :func:`example_records` of its last row, each
    completion cut to the schema's bound."""
    row = len(result.matrix) - 1
    if row < 0:
        return {}
    out = {}
    for column in result.columns:
        shown = [ExampleCompletion(id=r.id[:200], completion=r.completion[:EXAMPLE_CHARS],
                                   correct=r.correct)
                 for r in example_records(run_dir, row, column.name, EXAMPLES_PER_COLUMN)]
        if shown:
            out[column.name] = shown
    return out


def read_records(path: Path) -> list[ItemRecord]:
    """Read records written by :func:`write_records`."""
    with open(path, encoding="utf-8") as fh:
        return [ItemRecord(**json.loads(line)) for line in fh if line.strip()]
