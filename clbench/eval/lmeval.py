"""General-ability probes through lm-evaluation-harness, on the model in memory.

A probe column names an lm-eval task or group (a built-in one such as `mmlu`, one from an
``include_path`` folder, or a task YAML path). It runs in-process: lm-eval's HF wrapper is put
around the model being trained, so no checkpoint is written. clbench ships one small offline task,
``clbench_general_mc`` (``clbench/data/lmeval/``), so the path works without the hub.

The score is one lm-eval result key, ``metric,filter`` (:func:`result_key`); the cell's records
are the documents scored under that filter, from every leaf task when the probe names a group.
:func:`check_probe` finds an unknown name before a run loads its model.

The task folders a probe brings are prepared by :mod:`clbench.eval.lmeval_tasks`.

The inverse direction, writing a suite's tasks as lm-eval tasks, is
:mod:`clbench.eval.lmeval_export`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.eval.column import CellResult, summarise_cell
from clbench.eval.lmeval_tasks import OFFLINE_TASK, LmEvalProbeError, prepared_tasks
from clbench.eval.records import ItemRecord

if TYPE_CHECKING:
    from clbench.spec.schema import LmEvalProbe

# ---------------------------------------------------------------------------------------------
# Running a probe
# ---------------------------------------------------------------------------------------------

@contextmanager
def _task_manager(probe: LmEvalProbe, base_dir: Path | None) -> Iterator[tuple[str, Any]]:
    """Yield (task or group name, lm-eval TaskManager that knows it), inside the prepared folders.

    Raises :class:`LmEvalProbeError` for a name lm-eval does not know, or one that is only a tag
    (a tag runs its tasks but reports no score of its own).
    """
    from lm_eval.tasks import TaskManager

    with prepared_tasks(probe, base_dir) as (task, folders, need_defaults), _quiet_lm_eval():
        if need_defaults and not _mentioned(task, [*map(Path, folders), _builtin_task_dir()]):
            raise _unknown(task)
        manager = TaskManager(include_path=folders, include_defaults=need_defaults)
        entry = manager.task_index.get(task)
        if entry is None:
            raise _unknown(task)
        if entry.kind.name == "TAG":
            raise LmEvalProbeError(
                f"lm-eval name {task!r} is a tag: lm-eval reports no score for a tag, only for "
                f"each of its tasks; name one task, or a group with an `aggregate_metric_list`")
        promised = promised_keys(entry.cfg or {})
        if promised is not None:  # a bad metric fails now, not after the probe has run
            result_key(task, probe.metric, dict.fromkeys(promised))
        if not need_defaults and _refers_elsewhere(entry.cfg, manager.task_index):
            # a group of ours may gather built-in tasks (e.g. `task: [arc_easy, hellaswag]`)
            manager = TaskManager(include_path=folders, include_defaults=True)
        yield task, manager


def _refers_elsewhere(cfg: dict[str, Any] | None, index: dict[str, Any],
                     seen: frozenset[str] = frozenset()) -> bool:
    """Whether a group config names a member (through its subgroups) that `index` lacks."""
    if not cfg or "group" not in cfg:
        return False
    members = cfg.get("task")
    for member in members if isinstance(members, list) else [members]:
        if isinstance(member, dict) and "group" in member:
            if _refers_elsewhere(member, index, seen):
                return True
            continue
        name = member.get("task") if isinstance(member, dict) else member
        if not isinstance(name, str) or name in seen:
            continue
        if name not in index or _refers_elsewhere(index[name].cfg, index, seen | {name}):
            return True
    return False


def check_probe(probe: LmEvalProbe, base_dir: Path | None = None) -> None:
    """Fail now, not when the first row reaches the probe, if its task or group is unknown.

    Reads the task folders only. Naming a built-in task makes lm-eval index all of its tasks
    (~15 s); a name found in none of the task files is refused in about a second.
    """
    with _task_manager(probe, base_dir):
        pass  # entering it is the check: it raises for an unknown name or a bad metric


def _unknown(task: str) -> LmEvalProbeError:
    return LmEvalProbeError(
        f"lm-eval task {task!r} is unknown (offline task shipped with clbench: "
        f"{OFFLINE_TASK!r}; add a folder of task YAMLs with `include_path`)")


def _builtin_task_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def _mentioned(name: str, roots: Sequence[Path]) -> bool:
    """Whether `name` occurs in the text of any task file (YAML, or extensionless template).

    lm-eval reads every task, group and tag name from those files, so a name that occurs in none
    is unknown. Scanning the text takes ~1 s where lm-eval's index of its built-in tasks takes
    ~15 s, so a misspelled name is refused at once (a name that occurs goes to the index).
    """
    needle = name.encode()
    for root in roots:
        for path in root.rglob("*"):
            if path.suffix in ("", ".yaml", ".yml") and path.is_file() \
                    and needle in path.read_bytes():
                return True
    return False


def run_probe(column: str, model: Any, tokenizer: Any, probe: LmEvalProbe, *,
              batch_size: int = 8, base_dir: Path | None = None, seed: int = 0,
              bootstrap_samples: int = 1000) -> CellResult:
    """Score the in-memory model on one lm-eval task or group; one record per document.

    The score is lm-eval's own aggregate for the result key :func:`result_key` picks from
    ``probe.metric`` (for a group: the group's aggregate over its tasks). The records are the
    documents scored under that key's filter, with their per-document metric, so the cell's
    interval is over the items behind the score; a group's record ids are
    ``<task>/<doc_id>``. `seed` seeds lm-eval (few-shot sampling and the like).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    was_training = model.training
    device = str(next(model.parameters()).device)
    with _task_manager(probe, base_dir) as (task, manager):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
        out = simple_evaluate(model=lm, tasks=[task], num_fewshot=probe.num_fewshot,
                              limit=probe.limit, task_manager=manager, log_samples=True,
                              bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed)
    model.train(was_training)  # the wrapper switches the model to eval mode
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    results = out["results"]
    groups = out.get("group_subtasks") or {}
    leaves = _leaf_tasks(task, groups)
    key = result_key(task, probe.metric, results.get(task, {}),
                     [results.get(leaf, {}) for leaf in leaves])
    metric, filter_name = key.split(",", 1)
    records = []
    for leaf in leaves:
        if key not in results.get(leaf, {}):
            continue  # lm-eval leaves such a task out of the group's aggregate too
        prefix = f"{leaf}/" if task in groups else ""
        # one sample per (document, filter): keep the documents scored under the key's filter
        records += [_record(s, metric, prefix) for s in out["samples"].get(leaf, [])
                    if s.get("filter") == filter_name]
    cell = summarise_cell(column, records, bootstrap_samples)
    cell.source = "lm_eval"
    cell.score = float(results[task][key])  # lm-eval's own aggregate (not always a plain mean)
    cell.mean_reward = cell.score
    return cell


def result_key(task: str, metric: str, reported: dict[str, Any],
               members: Sequence[dict[str, Any]] = ()) -> str:
    """The `metric,filter` key of lm-eval's results that scores `task`.

    `metric` with a comma is the key itself; a bare metric means `metric,none` when that is
    reported, else the metric's only filter. `reported` is the task's (or group's) result,
    `members` those of a group's tasks, which say what a group without that aggregate lacks.
    """
    keys = {k for entry in [reported, *members] for k in entry
            if "," in k and "_stderr," not in k}
    if "," in metric:
        key = metric
    else:
        named = sorted(k for k in keys if k.split(",", 1)[0] == metric)
        if f"{metric},none" in named or not named:
            key = f"{metric},none"
        elif len(named) == 1:
            key = named[0]
        else:
            raise LmEvalProbeError(
                f"lm-eval task {task!r} reports {metric!r} under several filters: "
                f"{', '.join(named)}; name one as `metric: {named[0]}`")
    if key not in keys:
        raise LmEvalProbeError(f"lm-eval task {task!r} has no metric {metric!r}; it reports: "
                               f"{', '.join(sorted(keys)) or 'nothing'}")
    if key not in reported:
        raise LmEvalProbeError(
            f"lm-eval group {task!r} reports no aggregate for {key} (its tasks do); give the "
            f"group an `aggregate_metric_list` with that metric, or name one of its tasks")
    return key


def _metric_name(value: Any) -> str | None:
    """A metric as a config names it, or None for one given as code (`!function utils.f`, which
    lm-eval's index holds as a path or a function and reports under the function's name)."""
    if isinstance(value, str) and "/" not in value and "\\" not in value:
        return value
    return None


def promised_keys(cfg: dict[str, Any]) -> set[str] | None:
    """The `metric,filter` keys a task's (or group's) config says lm-eval will report, or None
    when the config does not say (metrics defined in code, a group without an aggregate)."""
    if "group" in cfg:
        keys = set()
        for m in cfg.get("aggregate_metric_list") or []:
            if not isinstance(m, dict) or _metric_name(m.get("metric")) is None:
                return None
            filters = m.get("filter_list") or "none"  # lm-eval's default for an aggregate
            keys |= {f"{m['metric']},{f}" for f in ([filters] if isinstance(filters, str)
                                                     else filters)}
        return keys or None
    metrics = [_metric_name(m.get("metric")) if isinstance(m, dict) else None
               for m in cfg.get("metric_list") or []]
    if not metrics or not all(isinstance(m, str) for m in metrics):
        return None
    filters = [f.get("name") if isinstance(f, dict) else None for f in cfg.get("filter_list") or []]
    if not all(isinstance(f, str) for f in filters):
        return None
    return {f"{m},{f}" for m in metrics for f in filters or ["none"]}


def _leaf_tasks(name: str, group_subtasks: dict[str, list[str]]) -> list[str]:
    """The tasks under `name`, through nested groups (`name` itself when it is a task)."""
    if name not in group_subtasks:
        return [name]
    return [leaf for child in group_subtasks[name] for leaf in _leaf_tasks(child, group_subtasks)]


def _record(sample: dict[str, Any], metric: str, prefix: str = "") -> ItemRecord:
    value = sample.get(metric)
    score = float(value) if isinstance(value, (int, float)) else 0.0
    return ItemRecord(id=f"{prefix}{sample.get('doc_id')}", completion=_response_text(sample),
                      reward=min(max(score, 0.0), 1.0), correct=score >= 1.0)


def _response_text(sample: dict[str, Any]) -> str:
    """The chosen continuation (multiple choice) or the generated text (generate_until)."""
    resps = sample.get("filtered_resps") or []
    args = sample.get("arguments") or []
    if resps and isinstance(resps[0], (list, tuple)) and len(args) == len(resps):
        best = max(range(len(resps)), key=lambda i: float(resps[i][0]))
        arg = args[best]
        return str(arg[1] if isinstance(arg, (list, tuple)) and len(arg) > 1 else arg)
    if resps and isinstance(resps[0], str):
        return resps[0]
    return str(resps[0]) if resps else ""


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs every step at INFO/WARNING and draws its own tqdm bars (building requests,
    running them) on stderr, through a run's own progress display; keep the console to the
    run's progress lines. The bars are silenced where lm-eval's modules hold tqdm (tqdm reads its
    `TQDM_DISABLE` switch once, at import, so an environment variable set now would not), and
    `datasets`' own (building a task's split the first time) through its switch."""
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    logger = logging.getLogger("lm_eval")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    swapped = _silence_bars("lm_eval")
    datasets_bars = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if datasets_bars:
            enable_progress_bars()
        logger.setLevel(previous)
        for module, original in swapped:
            module.tqdm = original


def _silence_bars(package: str) -> list[tuple[Any, Any]]:
    """Replace the `tqdm` of every loaded module of `package` that imported it with one whose
    bars are off; returns (module, original) pairs to put back."""
    import sys

    from tqdm import tqdm

    class SilentBar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    swapped = []
    for name, module in list(sys.modules.items()):
        if (name == package or name.startswith(package + ".")) and \
                isinstance(getattr(module, "tqdm", None), type) and \
                issubclass(module.tqdm, tqdm):
            swapped.append((module, module.tqdm))
            module.tqdm = SilentBar
    return swapped
