"""A run's spec built from a suite, a method and overrides, with every plugin's parameters checked.

Where :mod:`clbench.spec.suites` reads a suite as data, this module asks the installed plugins:
does every task source exist and accept its parameters (and can an offline source give the
items asked of it), does every method in the suite's `methods:` block accept its settings, is
the model name one clbench can load. :func:`build_run_spec` puts one run together from a suite,
a method, a seed and `--set` overrides, validated exactly as a file is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from clbench.errors import UserError
from clbench.models import absolute_model_name, check_model_name
from clbench.plugins import registry
from clbench.spec.reading import SpecError, describe_validation_error, placed, validate_model
from clbench.spec.schema import MethodSpec, ModelSpec, RunSpec, SuiteSpec, TaskSpec, joint_stage
from clbench.spec.suites import (
    apply_overrides,
    default_out_dir,
    load_suite,
    method_settings,
    override_source,
    resolve_suite,
    split_overrides,
)


def _size_problems(task: TaskSpec, trained: bool, eval_size: int, split: str = "eval"
                   ) -> list[str]:
    """Whether an offline source can give the items asked of it (`train_size` for a stage,
    `eval_size` for every column, from the training split after the `train_size` items when
    columns are scored on `validation` items): drawing them takes milliseconds, and finding out
    at the stage would come after row 0. Hub sources are checked when the run loads their
    data."""
    try:
        source = registry.build_task(task, where="params")
    except SpecError as exc:  # a combination of parameters the source refuses
        return [str(exc)]
    if source.origin != "offline":
        return []
    wanted = [("train_size", "train", task.train_size)] if trained else []
    size = task.eval_size or eval_size
    if split == "validation" and trained:
        wanted.append((f"eval_size (validation: {size} training items after train_size)",
                       "train", task.train_size + size))
    elif split == "validation":  # a probe trains on none: its first training items
        wanted.append(("eval_size (validation items of the training split)", "train", size))
    else:
        wanted.append(("eval_size", "eval", size))
    problems = []
    for field, part, count in wanted:
        try:
            source.examples(part, task.seed, count)  # type: ignore[arg-type]
        except UserError as exc:
            problems.append(f"{field}={count}: {exc}" if "(" not in field else f"{field}: {exc}")
    return problems


def validate_suite_plugins(suite: SuiteSpec, source: str | os.PathLike[str] | None = None) -> None:
    """Check that every task source exists and its parameters validate, in stages and probes.

    All problems are gathered into one :class:`SpecError`, one line each, so a user fixes a file
    in one pass. `source` (the suite file) prefixes the lines and anchors relative paths.
    """
    prefix = f"{source}: " if source else ""
    problems: list[str] = []
    tasks = [(f"stages[{i}].task", s.task, True) for i, s in enumerate(suite.stages)]
    tasks += [(f"probes[{i}].task", p.task, False) for i, p in enumerate(suite.probes) if p.task]
    for where, task, trained in tasks:
        try:
            registry.validate_task_params(task.source, task.params, where=f"{where}.params")
        except registry.PluginError as exc:
            problems.append(f"{prefix}{where}.source: {exc}")
            continue
        except SpecError as exc:
            problems += [f"{prefix}{line}" for line in str(exc).splitlines()]
            continue
        problems += [f"{prefix}{where}.{problem}" for problem in
                     _size_problems(task, trained, suite.protocol.eval_size,
                                    suite.protocol.split)]
    try:
        check_model_name(suite.model.name)
    except SpecError as exc:
        problems.append(f"{prefix}model.name: {exc}")
    problems += [f"{prefix}{line}" for line in method_settings_problems(suite)]
    base = Path(source).parent if source else None
    for i, probe in enumerate(suite.probes):
        include = probe.lm_eval.include_path if probe.lm_eval else None
        if include is None:
            continue
        folder = Path(include).expanduser()
        if not folder.is_absolute() and base is not None:
            folder = base / folder
        if not folder.is_dir():
            problems.append(f"{prefix}probes[{i}].lm_eval.include_path: folder {folder} does not "
                            "exist (relative paths resolve against the suite file)")
    if problems:
        raise SpecError("\n".join(placed(problems, str(source)) if source else problems))


def method_settings_problems(suite: SuiteSpec) -> list[str]:
    """Problems of the suite's `methods:` block, one line each, named by path: a method that is
    not installed, a field its config does not take, a value it refuses."""
    problems = []
    for name, params in suite.methods.items():
        try:
            registry.validate_method_params(name, params, where=f"methods.{name}")
        except registry.PluginError as exc:
            problems.append(f"methods.{name}: {exc}")
        except SpecError as exc:
            problems += str(exc).splitlines()
    return problems


def build_run_spec(suite_ref: str | os.PathLike[str], method_name: str, seed: int = 0,
                   out_dir: str | os.PathLike[str] | None = None,
                   overrides: Sequence[str] = (), model: str | None = None,
                   device: str = "auto", reuse_base_row: bool = True,
                   checkpoint_minutes: float = 15.0, joint: bool = False,
                   trust_remote_code: bool = False) -> RunSpec:
    """Everything one run needs, validated: suite (with overrides), method, model, seed.

    A model's own code runs only with `trust_remote_code` (the CLI's --trust-remote-code): a
    suite or an override that sets `model.trust_remote_code` is refused, so no file a user
    was handed runs code."""
    method_sets, model_sets, suite_sets = split_overrides(overrides)
    path = resolve_suite(suite_ref)
    suite = load_suite(path, suite_sets)
    validate_suite_plugins(suite, override_source(path, suite_sets))

    model_data = suite.model.model_dump()
    if model is not None:
        model_data["name"] = model
    model_data = apply_overrides(model_data, model_sets)
    model_spec = _validate_at(ModelSpec, model_data, "model")
    if model_spec.trust_remote_code:
        raise SpecError("model.trust_remote_code: a suite or an override cannot let a model "
                        "run its own code; pass --trust-remote-code to clbench run or sweep "
                        "if you trust the model's repository")
    model_spec = model_spec.model_copy(update={"trust_remote_code": trust_remote_code})
    if model_spec.name != suite.model.name:  # the suite's own was checked with the suite
        try:
            check_model_name(model_spec.name)
        except SpecError as exc:
            raise SpecError(f"{'--model' if model is not None else 'model.name'}: {exc}") \
                from None
    model_spec = model_spec.model_copy(update={"name": absolute_model_name(model_spec.name)})

    params = method_settings(suite, method_name, method_sets)
    registry.validate_method_params(method_name, params, where="method")
    out = os.fspath(out_dir) if out_dir is not None else default_out_dir(
        suite.name, method_name + ("-joint" if joint else ""), seed)
    if joint:
        try:
            joint_stage(suite.stages)
        except ValueError as exc:
            raise SpecError(f"--joint: {exc}") from None
    return validate_model(RunSpec, {
        "suite": suite, "method": MethodSpec(name=method_name, params=params),
        "model": model_spec, "seed": seed, "out_dir": out, "device": device,
        "suite_file": str(path), "reuse_base_row": reuse_base_row,
        "checkpoint_minutes": checkpoint_minutes, "joint": joint,
    }, "run")


def _validate_at(model: type[BaseModel], data: dict[str, Any], prefix: str) -> Any:
    """Validate `data` with messages that read `prefix.field: ...` (e.g. `model.dtype`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_validation_error(err, "", prefix)) from None
