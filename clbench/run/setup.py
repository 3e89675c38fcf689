"""What a run needs before its first row: its accelerator, its plugins checked against it, every
item it will use, its model; and `--plan`'s view of them (how `auto` resolves, the estimate).

Everything here can refuse a run, and does so before its folder is claimed
(:class:`clbench.run.recipe.RunRecipe`): a mistake found now leaves no folder behind, so the
corrected command can use the same `--out`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from clbench.errors import UserError
from clbench.plugins import registry
from clbench.results import git_revision, reset_peak_memory
from clbench.run.joint import MixedTasks, mixed_train_set
from clbench.run.rows import ColumnPlan, plan_columns
from clbench.seeding import derive_seed, seed_everything
from clbench.spec.schema import RunSpec
from clbench.tasks.base import TaskSizeError
from clbench.train.api import STAGE_KEY
from clbench.train.cpu import release_free_memory

if TYPE_CHECKING:
    from clbench.run.estimate import RunEstimate
    from clbench.tasks.base import Example, TaskSource
    from clbench.train.addons import AddOn
    from clbench.train.api import Method
    from clbench.train.distributed import Distributed

log = logging.getLogger("clbench.run.setup")


def make_distributed(run: RunSpec) -> Distributed:
    """The run's accelerator; refuses budgets that cannot be split over its processes."""
    from clbench.run.trackers import TRACKERS_FOLDER, check_trackers
    from clbench.train.distributed import Distributed
    from clbench.train.optim import rank_share

    check_trackers(run.report_to)  # before anything is loaded
    dist = Distributed.create(run.device, run.model.dtype, run.model.mixed_precision,
                              trackers=run.report_to,
                              tracker_dir=Path(run.out_dir) / TRACKERS_FOLDER)
    dist.take_cpu_share()
    for spec in run.training_stages():  # before anything trains, not when the stage comes
        rank_share(range(spec.budget.prompts_per_step), 0, dist.num_processes, spec.name)
    return dist


def check_sharding_support(run: RunSpec, method: Method, addons: Sequence[AddOn],
                           dist: Distributed) -> None:
    """Refuse a sharded launch (FSDP2) of a method or add-on that has not declared it trains
    through `train_model` alone (:attr:`clbench.train.api.Method.supports_sharding`): its
    gradients would reach the plain copy of the student, which nothing trains."""
    if dist.sharding is None:
        return
    named = [(f"the method {run.method.name!r}", method)]
    named += [(f"the add-on {spec.name!r}", addon) for spec, addon in zip(run.addons, addons)]
    for what, plugin in named:
        # declared by the plugin's own class: a subclass may train differently from its parent
        if not vars(type(plugin)).get("supports_sharding", False):
            raise UserError(f"{what} does not support sharded training ({dist.sharding}, from "
                            "the accelerate config): launch it without FSDP (data parallel, "
                            "or one process), or see docs/plugins.md for what a plugin must "
                            "do to declare `supports_sharding`")


def check_lm_eval_probes(run: RunSpec) -> None:
    """Refuse an unknown lm-eval task now, before the model loads, rather than when row 0
    reaches the probe's column (half an hour into a CPU run); and a task folder that carries
    Python unless the command line allowed it (`run.allow_task_code`): indexing the folder
    would run it."""
    probes = [(i, p.lm_eval) for i, p in enumerate(run.suite.probes) if p.lm_eval is not None]
    if probes:
        from clbench.eval.lmeval import check_probe
        from clbench.eval.lmeval_tasks import LmEvalProbeError
        from clbench.plugins.runspec import task_code_problem

        base = Path(run.suite_file).parent if run.suite_file else None
        for i, probe in probes:
            try:
                code = None if run.allow_task_code else task_code_problem(probe, base)
                if code:
                    raise LmEvalProbeError(code)
                check_probe(probe, base)
            except LmEvalProbeError as exc:
                where = f"{run.suite_file}: " if run.suite_file else ""
                raise LmEvalProbeError(f"{where}probes[{i}].lm_eval: {exc}") from None


def warn_if_another_checkout(name: str, origin: registry.Origin) -> None:
    """Warn when a method that ships with clbench is loaded from another checkout than
    clbench itself: a PYTHONPATH naming one checkout's `clbench` folder still imports the
    methods from the installed one (their package is `methods/`), so a run would mix two
    versions of the code while recording one commit."""
    own = git_revision()
    if origin.distribution == "clbench" and origin.source_revision and own \
            and origin.source_revision != own:
        log.warning("the method %r ships with clbench but its code is from a checkout at %s, "
                    "clbench's from one at %s: results.json records both; to run one version, "
                    "install the checkout you mean (pip install -e .) instead of pointing "
                    "PYTHONPATH at it", name, origin.source_revision, own)


def start_peak_memory(device: Any) -> None:
    """This run's peak memory, not an earlier run's in this process (an in-process sweep): what
    those runs left to the garbage collector and the C heap is given back first, so the peak
    starts from what the process really holds."""
    gc.collect()
    release_free_memory()
    if not reset_peak_memory(device):
        log.info("cannot reset the peak of resident memory here: the run records the process's "
                 "peak since it started")


class DrawnItems(NamedTuple):
    """Every item a run uses, drawn once, before its model loads."""

    plans: list[ColumnPlan]  # every column's eval items (or lm-eval probe)
    stage_tasks: list[TaskSource]  # what each of `run.training_stages()` trains on
    train_sets: list[list[Example] | None]  # each one's training items (None: stage done)
    tasks: dict[str, TaskSource]  # every stream stage's task by name (replayed items' graders)


def draw_items(run: RunSpec, first_stage: int = 1) -> DrawnItems:
    """Every item the run will still use, drawn before the model loads: a hub source that
    cannot give its training set (unreachable, too small, evaluation-only) is refused now, not
    after row 0. Items depend only on (params, split, seed, size), so drawing them early
    changes nothing; stages before `first_stage` are done and need no training items. Each
    training item carries its stage's name (:data:`clbench.train.api.STAGE_KEY`), so that,
    replayed in a later stage, it is graded by its own task."""
    plans, stage_tasks = plan_columns(run)
    train_sets: list[list[Example] | None] = []
    for i, (task, spec) in enumerate(zip(stage_tasks, run.suite.stages)):
        if i + 1 < first_stage and not run.joint:
            train_sets.append(None)
            continue
        try:
            drawn = task.examples("train", spec.task.seed, spec.task.train_size)
        except TaskSizeError as exc:
            raise TaskSizeError(f"stage {spec.name!r} (stages[{i}].task.train_size="
                                f"{spec.task.train_size}): {exc}") from None
        except UserError as exc:
            raise UserError(f"stage {spec.name!r} (stages[{i}].task): {exc}") from None
        train_sets.append([dataclasses.replace(e, metadata={**e.metadata, STAGE_KEY: spec.name})
                           for e in drawn])
    if run.joint:  # one stage over every stage's items
        seeds = [s.task.seed for s in run.suite.stages]
        mixed = mixed_train_set(train_sets, seeds)  # type: ignore[arg-type]
        caps = [s.budget.max_new_tokens for s in run.suite.stages]
        return DrawnItems(plans, [MixedTasks(stage_tasks, caps)],
                          [mixed if first_stage <= 1 else None], {})
    tasks = {spec.name: task for spec, task in zip(run.suite.stages, stage_tasks)}
    return DrawnItems(plans, stage_tasks, train_sets, tasks)


def load_model(run: RunSpec, dist: Distributed) -> tuple[Any, Any]:
    """(model, tokenizer) on the run's device, initialised from the run seed (tiny models)."""
    seed_everything(derive_seed(run.seed, "init"))
    return dist.load_model(run.model, seed=run.seed)


# ---------------------------------------------------------------------------------------------
# `clbench run --plan`
# ---------------------------------------------------------------------------------------------

def resolution(run: RunSpec) -> dict[str, Any]:
    """What the run's `auto` settings resolve to on this machine, without loading the model:
    its device, precision and (on the CPU) torch threads."""
    from clbench.models import resolve_device
    from clbench.train.cpu import process_allocator, run_threads
    from clbench.train.distributed import resolve_precision

    device = resolve_device(run.device)
    precision = resolve_precision(run.model.dtype, run.model.mixed_precision, device)
    out: dict[str, Any] = {"device": str(device), "precision": precision.label}
    if device.type == "cpu":
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        out["cpu_threads"] = run_threads(local) or torch.get_num_threads()
        if (kind := process_allocator()) is not None:
            out["allocator"] = kind
    return out


def estimate(run: RunSpec, on_step: Any = None) -> tuple[RunEstimate, dict[str, Any]]:
    """The run's estimate on this machine (:mod:`clbench.run.estimate`: a short calibration with
    its model, device, precision and method) and how its device resolved. Writes nothing."""
    from clbench.run.estimate import Calibration, estimate_run

    method = registry.build_method(run.method)
    dist = make_distributed(run)
    items = draw_items(run)
    model, tokenizer = load_model(run, dist)
    cal = Calibration(run, dist, model, tokenizer, method, on_step or (lambda what: None),
                      registry.build_addons(run.addons))
    resolved = {"device": str(dist.device), **dist.describe()}
    return estimate_run(cal, items.plans, items.stage_tasks, items.train_sets), resolved  # type: ignore[arg-type]
