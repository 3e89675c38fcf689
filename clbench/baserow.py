"""Row 0 of R (the base model's scores) shared between runs that would compute the same row.

Every method and, for a pretrained model under greedy decoding, every seed starts from the same
weights and is evaluated on the same items with the same decoding, so their row 0 is the same.
Evaluating it is a large share of a run (one of T+1 rows); a sweep of M methods x S seeds would
repeat it M*S times. The row is therefore cached under a key that covers everything it depends
on, and a run whose key is in the cache copies the row and its per-item records instead.

The key hashes: the evaluation items of every column (their ids, prompts, references and gold
answers, so a changed generator invalidates it), the probes, decoding, eval sizes and bootstrap
settings, the model spec, how the model was resolved (device, dtype), the library versions, a
fingerprint of clbench's own files, and the run seed whenever row 0 depends on it (a randomly
initialised `tiny-*` model, or sampled decoding). Stage budgets and the method are not in it:
they do not touch row 0. Third-party task plugins are covered through their items, not their
graders: pass `--no-base-cache` after changing a plugin's grader.

Layout: `<cache>/<key>/row.json` + `items/<column>.jsonl`, written into a temp folder
and renamed into place under a file lock, so concurrent runs (a sweep on several processes or
GPUs) compute each row once and never read half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.atomic import atomic_write_json, file_lock
from clbench.evaluation import records_path
from clbench.results import Cell

if TYPE_CHECKING:
    from clbench.rows import ColumnPlan
    from clbench.results import RunResult
    from clbench.specs import RunSpec

ROW_FILE = "row.json"


def cache_dir() -> Path:
    """`$CLBENCH_BASE_ROWS`, else `$CLBENCH_CACHE/base-rows` (default `~/.cache/clbench`)."""
    from clbench.models import cache_root

    override = os.environ.get("CLBENCH_BASE_ROWS")
    return Path(override).expanduser() if override else cache_root() / "base-rows"


def code_fingerprint() -> str:
    """Hash of clbench's own source and data files, so an edited grader or generator (in an
    editable install, under an unchanged version number) never meets a row cached before."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and path.suffix not in (".pyc",) and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def row_depends_on_seed(run: RunSpec) -> bool:
    """True when two seeds of this run would evaluate a different row 0."""
    from clbench.models import TINY_MODELS

    return run.model.name in TINY_MODELS or run.suite.protocol.decoding.temperature > 0


def base_row_key(run: RunSpec, plans: Sequence[ColumnPlan], result: RunResult) -> str:
    """The cache key of row 0 (see the module docstring for what it covers)."""
    protocol = run.suite.protocol
    columns = []
    for plan in plans:
        items = [dataclasses.asdict(ex) for ex in plan.examples]
        probe = plan.probe.model_dump(mode="json") if hasattr(plan.probe, "model_dump") else None
        columns.append({"name": plan.name, "items": items, "probe": probe})
    content = {
        "columns": columns,
        "decoding": protocol.decoding.model_dump(mode="json"),
        "bootstrap_samples": protocol.bootstrap_samples,
        "model": run.model.model_dump(mode="json"),
        "resolved": result.model.resolved,
        "versions": result.versions,
        "code": code_fingerprint(),
        "seed": run.seed if row_depends_on_seed(run) else None,
    }
    text = json.dumps(content, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def load_or_compute(key: str, column_names: Sequence[str], run_dir: Path,
                    compute: Callable[[], list[Cell | None]], root: Path | None = None,
                    ) -> tuple[list[Cell | None], bool]:
    """Row 0 from the cache (records copied into `run_dir`), else `compute()` and cache it.

    `compute` must write the row's per-item records into `run_dir` (as `evaluate_row` does). The
    lock is held while computing, so concurrent runs of one key compute it once. Returns the
    cells and whether they came from the cache.
    """
    root = root or cache_dir()
    with _locked(root, key):
        cached = lookup(key, column_names, run_dir, root, locked=True)
        if cached is not None:
            return cached, True
        cells = compute()
        store(key, column_names, cells, run_dir, root, locked=True)
        return cells, False


def lookup(key: str, column_names: Sequence[str], run_dir: Path, root: Path | None = None,
           locked: bool = False) -> list[Cell | None] | None:
    """The cached row of `key` with its records copied into `run_dir`, or None."""
    root = root or cache_dir()
    if not locked:
        with _locked(root, key):
            return lookup(key, column_names, run_dir, root, locked=True)
    entry = root / key
    cached = _read(entry, column_names)
    if cached is not None:
        for name in column_names:
            dst = records_path(run_dir, 0, name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry / "items" / f"{name}.jsonl", dst)
    return cached


def store(key: str, column_names: Sequence[str], cells: Sequence[Cell | None], run_dir: Path,
          root: Path | None = None, locked: bool = False) -> None:
    """Cache a row computed into `run_dir` (kept as it is when another run stored it first)."""
    root = root or cache_dir()
    if not locked:
        with _locked(root, key):
            return store(key, column_names, cells, run_dir, root, locked=True)
    if _read(root / key, column_names) is None:
        _store(root / key, column_names, cells, run_dir)
    return None


def _locked(root: Path, key: str) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    return file_lock(root / f".{key}.lock")


def _read(entry: Path, column_names: Sequence[str]) -> list[Cell | None] | None:
    path = entry / ROW_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("columns") != list(column_names):
        return None  # a hash collision is astronomically unlikely; a hand-edited entry is not
    return [None if c is None else Cell.model_validate(c) for c in data["cells"]]


def _store(entry: Path, column_names: Sequence[str], cells: Sequence[Cell | None],
           run_dir: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        (tmp / "items").mkdir()
        for name in column_names:
            shutil.copyfile(records_path(run_dir, 0, name), tmp / "items" / f"{name}.jsonl")
        atomic_write_json(tmp / ROW_FILE, {
            "columns": list(column_names),
            "cells": [None if c is None else c.model_dump(mode="json") for c in cells],
            "computed_in": str(run_dir)})
        tmp.chmod(0o755)  # mkdtemp makes 0700; the cache is shared like the model cache
        if entry.exists():  # an incomplete entry from a crash between the writes above
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

