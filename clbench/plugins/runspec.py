"""A run's spec built from a suite, a method and overrides, with every plugin's parameters checked.

Where :mod:`clbench.spec.suites` reads a suite as data, this module asks the installed plugins:
does every task source exist and accept its parameters (and can an offline source give the
items asked of it), does every method in the suite's `methods:` block accept its settings, is
the model name one clbench can load. :func:`build_run_spec` puts one run together from its
:class:`~clbench.spec.options.RunOptions` (a suite, a method and its add-ons, a seed, `--set`
overrides), validated exactly as a file is.
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
from clbench.spec.options import RunOptions
from clbench.spec.reading import SpecError, describe_validation_error, placed, validate_model
from clbench.spec.schema import (
    AddOnSpec,
    MethodSpec,
    ModelSpec,
    RunSpec,
    SuiteSpec,
    TaskSpec,
    joint_stage,
    run_folder_name,
)
from clbench.spec.suites import (
    apply_overrides,
    default_out_dir,
    load_suite,
    method_settings,
    override_source,
    resolve_suite,
    split_overrides,
    task_code,
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
            items = source.examples(part, task.seed, count)  # type: ignore[arg-type]
        except UserError as exc:
            problems.append(f"{field}={count}: {exc}" if "(" not in field else f"{field}: {exc}")
            continue
        if task.definition is not None and trained:  # SFT's target must grade correct
            problems += _reference_problems(source, items[:REFERENCES_CHECKED])
    return problems


#: How many items of a task file `validate` grades its references on.
REFERENCES_CHECKED = 3


def _reference_problems(source: Any, items: list[Any]) -> list[str]:
    """A task file whose reference template does not grade correct under its own grader (the
    reference is SFT's target): the first such item, with the grader's feedback."""
    for item in items:
        if not item.reference:  # none given (code tests make none): for on-policy methods
            continue
        grade = source.grade(item, item.reference)
        if not grade.correct:
            return [f"source: the reference of item {item.id} grades wrong under grader "
                    f"{source.definition.grader} ({grade.feedback or 'no feedback'}): check the "
                    "task file's reference and answer templates"]
    return []


def validate_suite_plugins(suite: SuiteSpec, source: str | os.PathLike[str] | None = None,
                           allow_task_code: bool = False) -> None:
    """Check that every task source exists and its parameters validate, in stages and probes,
    and that no lm-eval task folder of a probe carries Python unless `allow_task_code`.

    All problems are gathered into one :class:`SpecError`, one line each, so a user fixes a file
    in one pass. `source` (the suite file) prefixes the lines and anchors relative paths.
    """
    prefix = f"{source}: " if source else ""
    problems: list[str] = []
    tasks = [(f"stages[{i}].task", s.task, True) for i, s in enumerate(suite.stages)]
    tasks += [(f"probes[{i}].task", p.task, False) for i, p in enumerate(suite.probes) if p.task]
    for where, task, trained in tasks:
        try:
            registry.validate_task_params(task, where=f"{where}.params")
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
    for i, probe in enumerate(suite.probes):
        code = task_code_problem(probe.lm_eval, base) if probe.lm_eval and not allow_task_code \
            else None
        if code:
            problems.append(f"{prefix}probes[{i}].lm_eval: {code}")
    if problems:
        raise SpecError("\n".join(placed(problems, str(source)) if source else problems))


def task_code_problem(probe: Any, base: Path | None) -> str | None:
    """What is wrong with an lm-eval probe whose task folder carries Python (lm-eval would run
    it): None when it carries none."""
    code = task_code(probe, base)
    if not code:
        return None
    shown = ", ".join(str(p) for p in code[:3]) + (f" and {len(code) - 3} more"
                                                   if len(code) > 3 else "")
    return (f"its task files carry Python that lm-eval would run ({shown}); code runs only "
            "from what you name on the command line: pass --allow-task-code if you trust it")


def method_settings_problems(suite: SuiteSpec) -> list[str]:
    """Problems of the suite's `methods:` block and `addons:` list, one line each, named by
    path: a method or add-on that is not installed, a field its config does not take, a value
    it refuses."""
    problems = []
    for name, params in suite.methods.items():
        problems += _plugin_problems(registry.validate_method_params, name, params,
                                     f"methods.{name}")
    for i, addon in enumerate(suite.addons):
        problems += _plugin_problems(registry.validate_addon_params, addon.name, addon.params,
                                     f"addons[{i}]")
    return problems


def _plugin_problems(validate: Any, name: str, params: Any, where: str) -> list[str]:
    try:
        validate(name, params, where=where)
    except registry.PluginError as exc:
        return [f"{where}: {exc}"]
    except SpecError as exc:
        return str(exc).splitlines()
    return []


def build_run_spec(options: RunOptions) -> RunSpec:
    """Everything one run needs, validated: suite (with overrides), method and add-ons, model,
    seed.

    A model's own code runs only with `options.trust_remote_code` (the CLI's
    --trust-remote-code): a suite or an override that sets `model.trust_remote_code` is
    refused, so no file a user was handed runs code."""
    routed = split_overrides(options.sets)
    path = resolve_suite(options.suite)
    suite = load_suite(path, routed.suite)
    validate_suite_plugins(suite, override_source(path, routed.suite),
                           allow_task_code=options.allow_task_code)
    model_spec = _run_model(suite, options, routed.model)
    # the configs in force, defaults included: validated here once, recorded as they are
    params = registry.validate_method_params(
        options.method, method_settings(suite, options.method, routed.method),
        where="method").model_dump(mode="json")
    addons = run_addons(suite, options.addons, routed.addons)
    out = options.out_dir if options.out_dir is not None else default_out_dir(
        suite.name, run_folder_name(options.method, [a.name for a in addons], options.joint),
        options.seed)
    if options.joint:
        try:
            joint_stage(suite.stages)
        except ValueError as exc:
            raise SpecError(f"--joint: {exc}") from None
    return validate_model(RunSpec, {
        "suite": suite, "method": MethodSpec(name=options.method, params=params),
        "addons": addons, "model": model_spec, "seed": options.seed, "out_dir": out,
        "device": options.device, "suite_file": str(path),
        "reuse_base_row": options.reuse_base_row,
        "checkpoint_minutes": options.checkpoint_minutes, "joint": options.joint,
        "allow_task_code": options.allow_task_code, "report_to": options.report_to,
    }, "run")


def _run_model(suite: SuiteSpec, options: RunOptions, sets: list[str]) -> ModelSpec:
    """The run's model: the suite's, another named by --model, `model.X` overrides."""
    model_data = suite.model.model_dump()
    if options.model is not None:
        model_data["name"] = options.model
    model_data = apply_overrides(model_data, sets)
    model_spec = _validate_at(ModelSpec, model_data, "model")
    if model_spec.trust_remote_code:
        raise SpecError("model.trust_remote_code: a suite or an override cannot let a model "
                        "run its own code; pass --trust-remote-code to clbench run or sweep "
                        "if you trust the model's repository")
    model_spec = model_spec.model_copy(update={"trust_remote_code": options.trust_remote_code})
    if model_spec.name != suite.model.name:  # the suite's own was checked with the suite
        try:
            check_model_name(model_spec.name)
        except SpecError as exc:
            raise SpecError(f"{'--model' if options.model is not None else 'model.name'}: "
                            f"{exc}") from None
    return model_spec.model_copy(update={"name": absolute_model_name(model_spec.name)})


def run_addons(suite: SuiteSpec, named: Sequence[str], sets: dict[str, list[str]]
               ) -> list[AddOnSpec]:
    """The run's add-ons: the suite's `addons:` list, then each `--addon` not in it, with the
    `--set addon.NAME.X` overrides on top of their settings, each validated against its
    add-on's config."""
    addons = [a.model_copy(deep=True) for a in suite.addons]
    for name in named:
        if name not in [a.name for a in addons]:
            addons.append(AddOnSpec(name=name))
    listed = [a.name for a in addons]
    unused = [name for name in sets if name not in listed]
    if unused:
        raise SpecError(f"--set addon.{unused[0]}.*: the run has no add-on {unused[0]!r} (its "
                        f"add-ons: {', '.join(listed) or 'none'}); add --addon {unused[0]}")
    for addon in addons:
        params = apply_overrides(addon.params, sets.get(addon.name, []),
                                 example=f"addon.{addon.name}.FIELD=VALUE")
        addon.params = registry.validate_addon_params(
            addon.name, params, where=f"addon.{addon.name}").model_dump(mode="json")
    return addons


def _validate_at(model: type[BaseModel], data: dict[str, Any], prefix: str) -> Any:
    """Validate `data` with messages that read `prefix.field: ...` (e.g. `model.dtype`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_validation_error(err, "", prefix)) from None
