"""The continual protocol: evaluate the base model, then train and evaluate stage by stage.

`execute(run)` fills the accuracy matrix R of one run (row 0 = base model, row t = after stage
t) and keeps the run directory resumable at every moment:

    run.json                  identity of the run (suite hash, method and config, model, seed)
    results.json              the partial, then complete, result (atomic writes)
    run.log                   log file
    items/row{t}/{col}.jsonl  per-item evaluation records behind every cell
    stages/stage{t}.json      the method's full stage report (every step)
    checkpoints/stage{t}/     student weights, method state, RNG states of the last stage done

A stage counts as done once its row is in results.json; the checkpoint is written before the row,
so a run killed at any moment resumes from the last row on disk. Every stage re-seeds all RNGs
from (run seed, stage index), so a resumed run draws exactly the numbers an uninterrupted run
draws and, on CPU, ends with a bit-identical R.

Launched as several processes (accelerate, torchrun), every process runs this loop on its share
of the work (:mod:`clbench.engine.distributed`): training is data-parallel, each column's items are
split over the processes and their records gathered in item order, lm-eval probes run on the
main process. Only the main process writes files, logs and prints; a barrier follows each write.

`sweep` (a grid of methods x seeds) closes the module; tables live in :mod:`clbench.reporting`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clbench import baserow, registry
from clbench.atomic import atomic_write_json
from clbench.errors import UserError
from clbench.evaluation import CellResult, evaluate_column, make_generate_fn, records_path, \
    summarise_cell, write_records
from clbench.metrics.continual import compute_metrics
from clbench.reporting import collect_results, comparison, print_comparison, print_summary
from clbench.results import (
    RESULTS_FILENAME,
    Cell,
    MetricValue,
    RunResult,
    StageRecord,
    new_result,
    read_results,
    write_results,
)
from clbench.specs import RunSpec

if TYPE_CHECKING:
    import torch

    from clbench.engine.api import Method
    from clbench.engine.distributed import Distributed
    from clbench.tasks.base import Example, TaskSource

log = logging.getLogger("clbench.protocol")

IDENTITY_FILE = "run.json"
LOWER_IS_BETTER = {"forgetting", "intransigence"}


class RunDirError(UserError):
    """The run directory holds something this run must not overwrite."""


class RunInterrupted(UserError):
    """Ctrl-C: what was complete is saved; the run can be resumed."""

    exit_code = 130


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------

def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from a stable hash of `parts` (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    import torch

    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


# ---------------------------------------------------------------------------------------------
# Run directory: identity and refusal
# ---------------------------------------------------------------------------------------------

def run_identity(run: RunSpec, method_config: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs the same run: suite content, method and config, model, seed."""
    return {"suite": run.suite.name, "suite_hash": run.suite.content_hash(),
            "method": run.method.name, "method_config": method_config,
            "model": run.model.model_dump(mode="json"), "seed": run.seed}


def check_run_dir(run_dir: Path, identity: dict[str, Any], resume: bool) -> RunResult | None:
    """Refuse a directory of another run; return the existing result when resuming.

    Fresh start: the directory must be absent or empty. Resume: it must hold this very run
    (same suite hash, method config, model and seed) or be empty.
    """
    id_file = run_dir / IDENTITY_FILE
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    if not id_file.is_file():
        raise RunDirError(f"{run_dir} is not empty and holds no clbench run ({IDENTITY_FILE} "
                          "missing); choose another --out")
    found = json.loads(id_file.read_text(encoding="utf-8"))
    diffs = [k for k in identity if found.get(k) != identity[k]]
    if diffs:
        detail = "; ".join(f"{k}: {_short(found.get(k))} there, {_short(identity[k])} now"
                           for k in diffs)
        raise RunDirError(f"{run_dir} holds another run ({detail}); choose another --out")
    if not resume:
        raise RunDirError(f"{run_dir} already holds this run; pass --resume to continue it (or "
                          "print its results with `clbench report`), or choose another --out")
    path = run_dir / RESULTS_FILENAME
    return read_results(path) if path.is_file() else None


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, stage: int, model: Any, method: Method) -> Path:
    """Write `checkpoints/stage{stage}` atomically (a temp folder renamed into place)."""
    import torch
    from safetensors.torch import save_model

    final = run_dir / "checkpoints" / f"stage{stage}"
    tmp = run_dir / "checkpoints" / f".stage{stage}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "student.safetensors"))
    torch.save({"method": method.state_dict(), "rng": rng_states(), "stage": stage},
               tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(run_dir: Path, stage: int, model: Any, method: Method) -> None:
    """Restore student weights and method state of `stage` (RNGs are re-seeded per stage)."""
    import torch
    from safetensors.torch import load_model

    folder = run_dir / "checkpoints" / f"stage{stage}"
    if not (folder / "state.pt").is_file():
        raise RunDirError(f"{run_dir}: results say stage {stage} is done but its checkpoint "
                          f"{folder} is missing; the run cannot be resumed")
    load_model(model, str(folder / "student.safetensors"), device=str(model.device))
    state = torch.load(folder / "state.pt", map_location=model.device, weights_only=False)
    method.load_state_dict(state["method"])


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for old in (run_dir / "checkpoints").glob("stage*"):
        if old.name != f"stage{keep}":
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Columns and their evaluation
# ---------------------------------------------------------------------------------------------

class ColumnPlan:
    """How one column is evaluated: a clbench task's eval items, or an lm-eval probe."""

    def __init__(self, name: str, task: TaskSource | None = None,
                 examples: Sequence[Example] = (), probe: Any = None) -> None:
        self.name, self.task, self.examples, self.probe = name, task, list(examples), probe


def plan_columns(run: RunSpec) -> tuple[list[ColumnPlan], list[TaskSource]]:
    """Eval plans of every column (stream tasks, then probes) and the stage task sources."""
    suite = run.suite
    plans, stage_tasks = [], []
    for i, stage in enumerate(suite.stages):
        task = registry.build_task(stage.task, where=f"stages[{i}].task.params")
        stage_tasks.append(task)
        size = stage.task.eval_size or suite.protocol.eval_size
        plans.append(ColumnPlan(stage.name, task, task.examples("eval", stage.task.seed, size)))
    for i, probe in enumerate(suite.probes):
        if probe.task is not None:
            task = registry.build_task(probe.task, where=f"probes[{i}].task.params")
            size = probe.task.eval_size or suite.protocol.eval_size
            plans.append(ColumnPlan(probe.name, task, task.examples("eval", probe.task.seed, size)))
        else:
            plans.append(ColumnPlan(probe.name, probe=probe.lm_eval))
    return plans, stage_tasks


def evaluate_row(row: int, plans: Sequence[ColumnPlan], model: Any, tokenizer: Any,
                 run: RunSpec, run_dir: Path, progress: Progress,
                 dist: Distributed | None = None) -> list[CellResult]:
    """Evaluate every column with the model as it is now; save the items of each cell.

    With several processes each grades a contiguous share of a column's items; the records are
    gathered in item order and every process computes the same cell. lm-eval probes run on the
    main process (the others wait for its cell). Only the main process writes records.
    """
    decoding = run.suite.protocol.decoding
    generate = make_generate_fn(model, tokenizer, decoding, seed=derive_seed(run.seed, row, "eval"))
    world = dist.num_processes if dist is not None else 1
    main = dist is None or dist.is_main
    boot = run.suite.protocol.bootstrap_samples
    cells = []
    for plan in plans:
        boot_seed = derive_seed("bootstrap", plan.name, row)
        if plan.task is not None:
            examples = plan.examples
            if dist is not None and world > 1:
                from clbench.engine.distributed import eval_share

                share = eval_share(len(examples), dist.process_index, world)
                examples = examples[share.start:share.stop]
            cell = evaluate_column(plan.name, plan.task, examples, generate,
                                   batch_size=decoding.batch_size, bootstrap_samples=boot,
                                   bootstrap_seed=boot_seed, progress=progress,
                                   description=f"row {row}: eval {plan.name}")
            if dist is not None and world > 1:
                cell = summarise_cell(plan.name, dist.gather(cell.records), boot, boot_seed)
        else:
            cell = None
            if main:
                from clbench.lmeval import run_probe

                base = Path(run.suite_file).parent if run.suite_file else None
                cell = run_probe(plan.name, model, tokenizer, plan.probe, base_dir=base,
                                 batch_size=decoding.batch_size, seed=run.seed,
                                 bootstrap_samples=boot)
            if dist is not None:
                cell = dist.broadcast(cell)
            assert cell is not None
        if main:
            write_records(records_path(run_dir, row, plan.name), cell.records)
        log.info("row %d column %s: score %s over %d items", row, plan.name, cell.score, cell.n)
        cells.append(cell)
    return cells


def base_row(run: RunSpec, plans: Sequence[ColumnPlan], model: Any, tokenizer: Any,
             run_dir: Path, progress: Progress, result: RunResult, console: Console,
             dist: Distributed) -> list[Cell | None]:
    """Row 0: from the shared cache when an identical row was computed before, else evaluated
    (and cached). The result records which, under `artifacts["base_row"]`.

    One process holds the cache lock while it evaluates, so parallel runs of a sweep compute the
    row once. Several processes of one run evaluate together, so the main process looks the row up
    and tells the others (a lock held across a shared evaluation could deadlock).
    """
    def compute() -> list[Cell | None]:
        return to_cells(evaluate_row(0, plans, model, tokenizer, run, run_dir, progress, dist))

    if not run.reuse_base_row:
        return compute()
    key = baserow.base_row_key(run, plans, result)
    names = [p.name for p in plans]
    if dist.num_processes == 1:
        cells, reused = baserow.load_or_compute(key, names, run_dir, compute)
    else:
        found = dist.broadcast(baserow.lookup(key, names, run_dir) if dist.is_main else None)
        reused = found is not None
        cells = found if found is not None else compute()
        if dist.is_main and not reused:
            baserow.store(key, names, cells, run_dir)
    result.artifacts["base_row"] = {"key": key, "reused": reused,
                                    "cache": str(baserow.cache_dir())}
    if reused:
        log.info("row 0 taken from the base-row cache (key %s)", key)
        console.print(f"row 0 (base model): reused from {baserow.cache_dir() / key}")
    return cells


def to_cells(cells: Sequence[CellResult]) -> list[Cell | None]:
    out: list[Cell | None] = []
    for c in cells:
        if c.score is None:
            out.append(None)
            continue
        iv = c.interval or {}
        out.append(Cell(score=c.score, n=c.n, ci_low=iv.get("low"), ci_high=iv.get("high")))
    return out


def fill_metrics(result: RunResult, run: RunSpec) -> None:
    """Compute the protocol's metrics from R (with per-stage values and undefined-notes)."""
    matrix = [[np.nan if v is None else v for v in row] for row in result.score_matrix()]
    columns = [c.model_dump() for c in result.columns]
    computed = compute_metrics(np.array(matrix, dtype=float), columns, run.suite.protocol)
    metrics: dict[str, MetricValue] = {}
    for name, entry in computed.items():
        per_stage = entry.get("per_stage")
        metrics[name] = MetricValue(
            value=entry["value"], variant=entry["variant"], note=entry.get("note"),
            higher_is_better=name not in LOWER_IS_BETTER,
            per_stage=None if per_stage is None else
            [None if v is None else float(v) for v in per_stage])
        if entry["value"] is None:
            log.info("metric %s undefined: %s", name, entry.get("note"))
    result.metrics = metrics


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def _progress(console: Console, disable: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True, disable=disable)


def _attach_log(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "run.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("clbench")
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    return handler


def execute(run: RunSpec, resume: bool = False, console: Console | None = None) -> RunResult:
    """Run (or resume) one suite x method x seed and return its result.

    Raises :class:`RunDirError` for a directory of another run, :class:`RunInterrupted` on
    Ctrl-C (after saving what is complete). A method that raises leaves a `failed` result.
    """
    console = console or Console()
    if run.suite.protocol.diagnostics:
        # Declared in the schema so suites can be written against it; computing them is the
        # drift/collapse module's job. Refuse rather than silently report nothing.
        raise UserError("protocol.diagnostics "
                        f"{run.suite.protocol.diagnostics}: drift and collapse diagnostics are "
                        "not available in this version of clbench; remove them from the suite")
    run_dir = Path(run.out_dir)
    method = registry.build_method(run.method)
    method_config = method.config.model_dump(mode="json")
    identity = run_identity(run, method_config)
    dist = make_distributed(run)
    if not dist.is_main:
        console = Console(quiet=True)
    previous = check_run_dir(run_dir, identity, resume)
    dist.wait()  # every process has looked at the directory before the main one writes to it
    if previous is not None and previous.status == "complete":
        console.print(f"[green]{run_dir} is already complete[/]")
        print_summary(console, previous)
        return previous
    handler = None
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / IDENTITY_FILE, identity)
        handler = _attach_log(run_dir)
    dist.wait()
    try:
        return _execute(run, run_dir, method, method_config, previous, console, dist)
    finally:
        if handler is not None:
            logging.getLogger("clbench").removeHandler(handler)
            handler.close()


def make_distributed(run: RunSpec) -> Distributed:
    """The run's accelerator; refuses budgets that cannot be split over its processes."""
    from clbench.engine.distributed import Distributed
    from clbench.engine.optim import rank_share

    dist = Distributed.create(run.device, run.model.dtype, run.model.mixed_precision)
    for spec in run.suite.stages:  # before anything trains, not when the stage comes
        rank_share(range(spec.budget.prompts_per_step), 0, dist.num_processes, spec.name)
    return dist


def _execute(run: RunSpec, run_dir: Path, method: Method, method_config: dict[str, Any],
             previous: RunResult | None, console: Console, dist: Distributed) -> RunResult:
    from clbench.engine.api import StageContext
    from clbench.models import load_model

    clock = _Clock()
    device, main = dist.device, dist.is_main
    seed_everything(derive_seed(run.seed, "init"))
    model, tokenizer = load_model(run.model, device=device, dtype=dist.precision.weights,
                                  seed=run.seed)
    train_model = dist.prepare_student(model)  # once per run: DDP keeps its buffers
    plans, stage_tasks = plan_columns(run)
    result = previous or new_result(run, method_config)
    result.status, result.error = "partial", None  # a failed run that is resumed is partial again
    done = max(0, len(result.matrix) - 1)
    if done:
        load_checkpoint(run_dir, done, model, method)
        log.info("resuming %s after stage %d", run_dir, done)
        console.print(f"resuming after stage {done} of {len(run.suite.stages)}")
    result.model.resolved = {"dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                             "parameters": sum(p.numel() for p in model.parameters()),
                             "device": str(device), **dist.describe()}
    stage = done
    try:
        with _progress(console, disable=not main) as progress, dist.autocast():
            if not result.matrix:
                seed_everything(derive_seed(run.seed, 0))
                result.matrix.append(base_row(run, plans, model, tokenizer, run_dir, progress,
                                              result, console, dist))
                result.row_labels.append("base")
                if main:
                    write_results(run_dir / RESULTS_FILENAME, result)
                dist.wait()
            stages_bar = progress.add_task("stages", total=len(run.suite.stages), completed=done)
            for stage in range(done + 1, len(run.suite.stages) + 1):
                spec = run.suite.stages[stage - 1]
                stage_seed = derive_seed(run.seed, stage)
                seed_everything(stage_seed)
                steps_bar = progress.add_task(f"stage {stage} {spec.name}: train",
                                              total=spec.budget.steps)

                def log_step(record: dict[str, Any], bar: Any = steps_bar, s: int = stage) -> None:
                    progress.advance(bar)
                    log.info("stage %d step %s", s, json.dumps(record, default=str))

                task = stage_tasks[stage - 1]
                ctx = StageContext(
                    model=model, tokenizer=tokenizer, task=task,
                    train_examples=task.examples("train", spec.task.seed, spec.task.train_size),
                    budget=spec.budget, stage_index=stage, stage_name=spec.name, seed=stage_seed,
                    device=device, work_dir=run_dir / "work" / f"stage{stage}", log_step=log_step,
                    dist=dist, train_model=train_model)
                ctx.work_dir.mkdir(parents=True, exist_ok=True)
                report = method.train_stage(ctx)
                progress.remove_task(steps_bar)
                seed_everything(derive_seed(run.seed, stage, "eval"))
                cells = evaluate_row(stage, plans, model, tokenizer, run, run_dir, progress, dist)
                if main:
                    atomic_write_json(run_dir / "stages" / f"stage{stage}.json", {
                        "steps": report.steps, "counters": report.counters,
                        "wall_time": report.wall_time, "extra": report.extra}, indent=None)
                    save_checkpoint(run_dir, stage, model, method)
                result.stages.append(StageRecord(
                    index=stage, name=spec.name, summary=report.summary(),
                    counters=report.counters, wall_time=report.wall_time,
                    extra=json.loads(json.dumps(report.extra, default=str))))
                result.matrix.append(to_cells(cells))
                result.row_labels.append(f"after {spec.name}")
                _account(result, clock.lap(), device)
                if main:
                    write_results(run_dir / RESULTS_FILENAME, result)
                    prune_checkpoints(run_dir, stage)
                dist.wait()
                progress.advance(stages_bar)
                log.info("stage %d (%s) done", stage, spec.name)
    except KeyboardInterrupt:
        log.warning("interrupted during stage %d", stage)
        raise RunInterrupted(f"interrupted; stages 1..{len(result.matrix) - 1} are saved in "
                             f"{run_dir}. Continue with the same command plus --resume") from None
    except Exception as exc:
        result.status = "failed"
        result.error = f"stage {stage}: {type(exc).__name__}: {exc}"
        if main:
            write_results(run_dir / RESULTS_FILENAME, result)
        log.exception("run failed")
        raise
    result.status = "complete"
    fill_metrics(result, run)
    _account(result, clock.lap(), device)
    if main:
        write_results(run_dir / RESULTS_FILENAME, result)
        shutil.rmtree(run_dir / "work", ignore_errors=True)
    dist.wait()
    print_summary(console, result)
    return result


class _Clock:
    """Seconds between readings, so wall time adds up across resumed sessions."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self.last = now - self.last, now
        return elapsed


def _account(result: RunResult, elapsed: float, device: torch.device) -> None:
    """Tokens over all stages, wall time (added across resumed sessions), device, peak memory."""
    import resource

    import torch

    tokens: dict[str, int] = {}
    for st in result.stages:
        for k, v in st.counters.items():
            tokens[k] = tokens.get(k, 0) + int(v)
    result.compute.tokens = tokens
    result.compute.wall_time_s += elapsed
    result.compute.device = str(device)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    result.compute.peak_memory_bytes = max(peak, result.compute.peak_memory_bytes or 0)


def sweep(suite_ref: str, methods: Sequence[str], seeds: Sequence[int], out_root: str | Path,
          overrides: Sequence[str] = (), model: str | None = None, device: str = "auto",
          reuse_base_row: bool = True, console: Console | None = None) -> dict[str, Any]:
    """Run methods x seeds into `out_root/<method>/s<seed>`: complete runs are skipped,
    partial ones resumed. Ends with the comparison table over seeds."""
    from clbench.suites import build_run_spec

    console = console or Console()
    runs = [build_run_spec(suite_ref, m, seed=s, out_dir=Path(out_root) / m / f"s{s}",
                           overrides=overrides, model=model, device=device,
                           reuse_base_row=reuse_base_row)
            for m in methods for s in seeds]  # validate the whole grid before training
    dirs = []
    for run in runs:
        run_dir = Path(run.out_dir)
        dirs.append(run_dir)
        existing = run_dir / RESULTS_FILENAME
        if existing.is_file():
            status = read_results(existing).status
            if status == "complete":
                method = registry.build_method(run.method)
                check_run_dir(run_dir, run_identity(run, method.config.model_dump(mode="json")),
                              resume=True)
                console.print(f"[dim]skip {run.method.name} seed {run.seed}: complete[/]")
                continue
        resume = (run_dir / IDENTITY_FILE).is_file()
        console.rule(f"{run.method.name} seed {run.seed}" + (" (resume)" if resume else ""))
        try:
            execute(run, resume=resume, console=console)
        except RunInterrupted:
            raise
        except UserError:
            raise
        except Exception as exc:  # one broken run must not lose the rest of the grid
            console.print(f"[red]{run.method.name} seed {run.seed} failed: {exc}[/]")
    data = comparison([r for _, r in collect_results([d for d in dirs
                                                      if (d / RESULTS_FILENAME).is_file()])])
    print_comparison(console, data)
    return data
