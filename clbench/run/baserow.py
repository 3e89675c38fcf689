"""Row 0 of R (the base model's scores) shared between runs that would compute the same row.

Every method and, for a pretrained model under greedy decoding, every seed starts from the same
weights and is evaluated on the same items with the same decoding, so their row 0 is the same.
Evaluating it is a large share of a run (one of T+1 rows); a sweep of M methods x S seeds would
repeat it M*S times. The row is therefore cached under a key that covers everything it depends
on, and a run whose key is in the cache copies the row and its per-item records instead.

The key hashes: the evaluation items of every column (ids, prompts, references, gold answers)
and the source and params that grade them; each lm-eval probe and the files of a user-supplied
lm-eval task; decoding and bootstrap settings; the model spec and a fingerprint of its weights
(the embedded model's package version, a local folder's file sizes and times); how the model was
resolved (device kind, dtype, precision, processes); the library versions; a fingerprint of
clbench's own files; and the run seed whenever row 0 depends on it (a randomly initialised
`tiny-*` model, or sampled decoding). Stage budgets and the method are not in it: they do not
touch row 0. Third-party graders are covered through their items, params and `version`, not
their code: pass `--no-base-cache` after editing one in place without bumping its version.

:func:`base_row` wraps the evaluation of a row (:func:`clbench.run.rows.evaluate_row`) with the
cache; :func:`evaluation_stamp`, the key with the process's library versions, also stamps the
columns of every later row, so a resumed row keeps only columns evaluated the same way.

Layout: `<cache>/<key>/row.json` + `items/<column>.jsonl`, written into a temp folder
and renamed into place under a file lock, so concurrent runs (a sweep on several processes or
GPUs) compute each row once and never read half of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.atomic import atomic_dir, atomic_write_json, file_lock
from clbench.eval.records import records_path
from clbench.results import Cell, RunResult
from clbench.run.rows import evaluate_row, to_cells

if TYPE_CHECKING:
    from clbench.run.context import RunContext
    from clbench.run.rows import ColumnPlan
    from clbench.spec.schema import RunSpec

ROW_FILE = "row.json"

log = logging.getLogger("clbench.run.baserow")


def cache_dir() -> Path:
    """`$CLBENCH_BASE_ROWS`, else `$CLBENCH_CACHE/base-rows` (default `~/.cache/clbench`)."""
    from clbench.models import cache_root

    override = os.environ.get("CLBENCH_BASE_ROWS")
    return Path(override).expanduser() if override else cache_root() / "base-rows"


def code_fingerprint() -> str:
    """Hash of clbench's own source and data files, so an edited grader or generator (in an
    editable install, under an unchanged version number) never meets a row cached before."""
    package = Path(__file__).resolve().parents[1]  # the whole clbench package
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


def model_fingerprint(name: str) -> dict[str, Any]:
    """What identifies the weights behind a model name beyond the name itself: the embedded
    model's package version, or the size and mtime of a local folder's files (a checkpoint
    retrained in place). Hub ids rely on their `revision` (resolving it needs the network)."""
    from importlib import metadata

    from clbench.models import EMBEDDED_MODEL, EMBEDDED_PACKAGE, TINY_MODELS

    if name == EMBEDDED_MODEL:
        try:
            return {"package": metadata.version(EMBEDDED_PACKAGE)}
        except metadata.PackageNotFoundError:
            return {}
    path = Path(name).expanduser()
    if name in TINY_MODELS or not path.is_dir():
        return {}
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(path.iterdir()) if f.is_file()}


def files_fingerprint(folders: Sequence[Path]) -> str:
    """Hash of every file under `folders` (names and bytes): an edited lm-eval task or its data."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            if path.is_file():
                digest.update(str(path.relative_to(folder)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _evaluated_model(run: RunSpec) -> dict[str, Any]:
    """The model spec as evaluation uses it: an engine that only draws training rollouts
    (`generation: vllm`) evaluates with the decode loop, so it shares the loop's rows."""
    from clbench.train.rollout import evaluation_engine

    spec = run.model.model_dump(mode="json")
    spec["generation"] = evaluation_engine(spec["generation"])
    return spec


def base_row_key(run: RunSpec, plans: Sequence[ColumnPlan], resolved: dict[str, Any],
                 versions: dict[str, str]) -> str:
    """The cache key of row 0 (see the module docstring for what it covers): `resolved` is how
    the model was resolved (``RunResult.model.resolved``), `versions` the library versions of
    the process that evaluates (:func:`clbench.results.collect_versions`)."""
    from clbench.spec.suites import probe_task_folders

    protocol = run.suite.protocol
    base_dir = Path(run.suite_file).parent if run.suite_file else None
    columns = []
    for plan in plans:
        column: dict[str, Any] = {"name": plan.name}
        if plan.task is not None:  # the source and params grade; the items are what is graded
            column["source"] = plan.task.name
            column["version"] = type(plan.task).version
            digest = type(plan.task).content_digest()
            if digest is not None:  # a task file: an edit without a version bump is another
                column["definition"] = digest
            column["params"] = plan.task.params.model_dump(mode="json")
            column["items"] = [dataclasses.asdict(ex) for ex in plan.examples]
        else:
            column["probe"] = plan.probe.model_dump(mode="json")
            column["files"] = files_fingerprint(probe_task_folders(plan.probe, base_dir))
        columns.append(column)
    resolved = dict(resolved)
    # the kind of device, not its index: runs pinned to different GPUs share the row
    resolved["device"] = str(resolved.get("device", "")).split(":")[0]
    # which malloc served the process changes no number (the same tokens under glibc and jemalloc)
    resolved.pop("allocator", None)
    content = {
        "columns": columns,
        "decoding": protocol.decoding.model_dump(mode="json"),
        "bootstrap_samples": protocol.bootstrap_samples,
        "model": _evaluated_model(run),
        "weights": model_fingerprint(run.model.name),
        "resolved": resolved,
        "versions": versions,
        "code": code_fingerprint(),
        "seed": run.seed if row_depends_on_seed(run) else None,
    }
    text = json.dumps(content, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def load_or_compute(key: str, column_names: Sequence[str], run_dir: Path,
                    compute: Callable[[], list[Cell | None]], root: Path | None = None,
                    on_wait: Callable[[], None] | None = None,
                    ) -> tuple[list[Cell | None], bool]:
    """Row 0 from the cache (records copied into `run_dir`), else `compute()` and cache it.

    `compute` must write the row's per-item records into `run_dir` (as `evaluate_row` does). The
    lock is held while computing, so concurrent runs of one key compute it once; a run that finds
    it held calls `on_wait` and waits for the row. A cache that cannot be used (unwritable folder,
    damaged entry) is a miss with a warning, never a failed run. Returns the cells and whether
    they came from the cache.
    """
    root = root or cache_dir()
    with _locked(root, key, on_wait) as locked:
        cached = lookup(key, column_names, run_dir, root, locked=True) if locked else None
        if cached is not None:
            return cached, True
        cells = compute()
        if locked:
            store(key, column_names, cells, run_dir, root, locked=True)
        return cells, False


def lookup(key: str, column_names: Sequence[str], run_dir: Path, root: Path | None = None,
           locked: bool = False, on_wait: Callable[[], None] | None = None,
           ) -> list[Cell | None] | None:
    """The cached row of `key` with its records copied into `run_dir`, or None."""
    root = root or cache_dir()
    if not locked:
        with _locked(root, key, on_wait) as ok:
            return lookup(key, column_names, run_dir, root, locked=True) if ok else None
    entry = root / key
    try:
        cached = _read(entry, column_names)
        if cached is not None:
            for name in column_names:
                dst = records_path(run_dir, 0, name)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(entry / "items" / f"{name}.jsonl", dst)
        return cached
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged entry: evaluate instead
        log.warning("base-row cache entry %s unusable (%s); evaluating row 0", entry, exc)
        return None


def store(key: str, column_names: Sequence[str], cells: Sequence[Cell | None], run_dir: Path,
          root: Path | None = None, locked: bool = False) -> None:
    """Cache a row computed into `run_dir` (kept as it is when another run stored it first)."""
    root = root or cache_dir()
    if not locked:
        with _locked(root, key) as ok:
            if ok:
                store(key, column_names, cells, run_dir, root, locked=True)
        return
    try:
        existing = _read(root / key, column_names)
    except (OSError, ValueError, KeyError, TypeError):
        existing = None  # damaged: replaced below
    try:
        if existing is None:
            with atomic_dir(root / key) as tmp:
                (tmp / "items").mkdir()
                for name in column_names:
                    shutil.copyfile(records_path(run_dir, 0, name),
                                    tmp / "items" / f"{name}.jsonl")
                atomic_write_json(tmp / ROW_FILE, {
                    "columns": list(column_names),
                    "cells": [None if c is None else c.model_dump(mode="json") for c in cells],
                    "computed_in": str(run_dir)})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("could not cache row 0 under %s (%s)", root / key, exc)


@contextlib.contextmanager
def _locked(root: Path, key: str, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """The key's lock; yields False (with a warning) when the cache folder cannot be used."""
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            stack.enter_context(file_lock(root / f".{key}.lock", on_wait))
        except OSError as exc:
            log.warning("base-row cache %s unusable (%s); evaluating row 0 without it", root, exc)
            yield False
            return
        yield True


def _read(entry: Path, column_names: Sequence[str]) -> list[Cell | None] | None:
    path = entry / ROW_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("columns") != list(column_names):
        return None  # a hash collision is astronomically unlikely; a hand-edited entry is not
    return [None if c is None else Cell.model_validate(c) for c in data["cells"]]


def evaluation_stamp(run: RunSpec, plans: Sequence[ColumnPlan], resolved: dict[str, Any]) -> str:
    """What a row's evaluation depends on besides the weights, as a key: row 0's cache key
    (:func:`base_row_key`) with this process's library versions. `resolved` is
    how the model was resolved (``RunResult.model.resolved``)."""
    from clbench.results import collect_versions

    return base_row_key(run, plans, resolved, collect_versions())


def base_row(ctx: RunContext, result: RunResult) -> list[Cell | None]:
    """Row 0: from the shared cache when an identical row was computed before, else evaluated
    (and cached). The result records which, under `artifacts["base_row"]`.

    One process holds the cache lock while it evaluates, so parallel runs of a sweep compute the
    row once. Several processes of one run evaluate together, so the main process looks the row up
    and tells the others (a lock held across a shared evaluation could deadlock). The cache key
    is the evaluation's stamp (:func:`evaluation_stamp`).
    """
    run_dir, dist = ctx.run_dir, ctx.dist

    def say(text: str) -> None:
        if ctx.console is not None:
            with contextlib.suppress(OSError):  # a closed stdout must not disable the cache
                ctx.console.print(text, soft_wrap=True)

    def compute() -> list[Cell | None]:
        return to_cells(evaluate_row(ctx, 0))

    if not ctx.run.reuse_base_row:
        return compute()
    key = ctx.stamp
    names = [p.name for p in ctx.plans]

    def announce_wait() -> None:  # a sweep's other runs start together and share one row 0
        log.info("row 0: another run holds the cache entry of the same row (key %s), "
                 "evaluating or copying it; waiting for it", key)
        say("row 0 (base model): another run is evaluating (or copying) the same row; waiting "
            f"to reuse it ({cache_dir() / key})")

    if dist is None or dist.num_processes == 1:
        cells, reused = load_or_compute(key, names, run_dir, compute, on_wait=announce_wait)
    else:
        found = dist.broadcast(lookup(key, names, run_dir, on_wait=announce_wait)
                               if dist.is_main else None)
        reused = found is not None
        cells = found if found is not None else compute()
        if dist.is_main and not reused:
            store(key, names, cells, run_dir)
    result.artifacts["base_row"] = {"key": key, "reused": reused, "cache": str(cache_dir())}
    if reused:
        log.info("row 0 taken from the base-row cache (key %s)", key)
        say(f"row 0 (base model): reused from {cache_dir() / key}")
    return cells
