"""Finding suites by name or path, applying `--set` overrides, and building a run's spec.

A suite is named by its file stem (`starter` -> `suites/starter.yaml`) or given as a path.
Names are looked up in the folders of the `CLBENCH_SUITE_PATH` environment variable (separated
like `PATH`), then in the suites shipped with clbench; the first match wins.

Overrides are `KEY=VALUE` strings. In :func:`build_run_spec`, keys under `method.` are method
parameters, keys under `model.` change the run's model, and every other key edits the suite
(`stages[0].budget.steps=4`). Whatever the route, the result is validated exactly like a file,
and errors name the file, the override, the field path and what was expected.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from clbench import registry
from clbench.errors import UserError
from clbench.models import absolute_model_name, check_model_name
from clbench.spec_reading import (
    SpecError,
    apply_override,
    describe_validation_error,
    parse_override,
    read_yaml,
    validate_model,
)
from clbench.specs import MethodSpec, ModelSpec, RunSpec, SuiteSpec, TaskSpec, joint_stage

SUITE_PATH_ENV = "CLBENCH_SUITE_PATH"
SUITE_SUFFIXES = (".yaml", ".yml")


class SuiteNotFoundError(UserError):
    """A suite name that matches no file in the search path."""


@dataclass(frozen=True)
class SuiteInfo:
    """One suite as `clbench list suites` shows it."""

    name: str
    description: str
    path: Path


def suite_dirs() -> list[Path]:
    """Folders searched for named suites, in priority order (existing folders only)."""
    dirs = [Path(p).expanduser() for p in os.environ.get(SUITE_PATH_ENV, "").split(os.pathsep)
            if p.strip()]
    dirs.append(_shipped_suites())
    seen: set[Path] = set()
    out: list[Path] = []
    for d in dirs:
        key = d.resolve()
        if key not in seen and d.is_dir():
            seen.add(key)
            out.append(d)
    return out


def _shipped_suites() -> Path:
    """The folder of the suites clbench ships: `suites/` of a source checkout, installed as the
    data package `clbench_suites`."""
    import clbench_suites

    return Path(clbench_suites.__file__).resolve().parent


def _named_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in suite_dirs():
        for f in sorted(d.iterdir()):
            if f.suffix in SUITE_SUFFIXES and f.is_file():
                found.setdefault(f.stem, f)
    return found


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or "/" in ref or ref.endswith(SUITE_SUFFIXES)


def resolve_suite(ref: str | os.PathLike[str]) -> Path:
    """The file of suite `ref`: a path to a YAML file, or a name from the search path."""
    text = os.fspath(ref)
    named = _named_files()
    if _looks_like_path(text) or Path(text).is_file():
        path = Path(text).expanduser()
        if path.is_file():
            return path
        if path.name == text and path.stem in named:  # `starter.yaml` means the named suite
            return named[path.stem]
        if path.is_dir():
            raise SuiteNotFoundError(f"{path}: is a folder; name a suite file in it (e.g. "
                                     f"{path / '*.yaml'})")
        if path.exists():
            raise SuiteNotFoundError(f"{path}: not a regular file, so not a suite file")
        raise SuiteNotFoundError(f"{path}: no such suite file")
    if text in named:
        return named[text]
    close = difflib.get_close_matches(text, list(named), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    known = ", ".join(named) if named else "none found"
    searched = ", ".join(str(d) for d in suite_dirs()) or "no folder"
    raise SuiteNotFoundError(f"unknown suite {text!r}.{hint} Known suites: {known} (searched "
                             f"{searched}; add folders with {SUITE_PATH_ENV} or pass a path).")


def list_suites() -> list[SuiteInfo]:
    """Every named suite; an unreadable or invalid file says so in its description."""
    infos = []
    for name, path in _named_files().items():
        try:
            data = read_yaml(path)
            description = str(data.get("description", "")) if isinstance(data, dict) else ""
        except SpecError as exc:
            description = f"(invalid: {exc})"
        infos.append(SuiteInfo(name, _first_line(description), path))
    return infos


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _override_source(path: Path, overrides: Sequence[str]) -> str:
    if not overrides:
        return str(path)
    return f"{path} (with --set {' --set '.join(overrides)})"


def apply_overrides(data: dict[str, Any], overrides: Sequence[str],
                    example: str = "stages[0].budget.steps=4") -> dict[str, Any]:
    """A deep copy of `data` with every `KEY=VALUE` override applied in order (`example` is
    the one a malformed override is shown)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text, example)
        apply_override(out, path, value)
    return out


def load_suite(ref: str | os.PathLike[str], overrides: Sequence[str] = ()) -> SuiteSpec:
    """Read, override and validate a suite (plugin parameters are checked separately, by
    :func:`validate_suite_plugins`)."""
    path = resolve_suite(ref)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of suite fields at the top level, got "
                        f"{type(data).__name__}")
    data = apply_overrides(data, overrides)
    return validate_model(SuiteSpec, data, _override_source(path, overrides))


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
        raise SpecError("\n".join(problems))


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


def method_settings(suite: SuiteSpec, method: str, overrides: Sequence[str] = ()
                    ) -> dict[str, Any]:
    """The parameters a run of `method` gets: the suite's `methods.<method>` block, then the
    `--set method.X` overrides (prefix removed) on top."""
    return apply_overrides(suite.methods.get(method, {}), overrides)


def default_out_dir(suite_name: str, method: str, seed: int) -> str:
    """Where a run's results go unless `--out` says otherwise."""
    return str(Path("runs") / suite_name / method / f"s{seed}")


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Route overrides: (`method.*` with the prefix removed, `model.*` likewise, the rest)."""
    method, model, suite = [], [], []
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        for prefix, bucket in (("method.", method), ("model.", model)):
            if key.startswith(prefix):
                if "=" not in text:  # said here: past this point the prefix is gone
                    raise SpecError(f"override {text!r}: expected KEY=VALUE, e.g. "
                                    f"{key}={'1e-5' if key == 'method.lr' else '...'}")
                bucket.append(text.strip()[len(prefix):])
                break
        else:
            if key in ("method", "model"):
                raise SpecError(f"override {text!r}: set one field at a time, e.g. "
                                f"{key}.{'lr=1e-5' if key == 'method' else 'dtype=float32'}")
            suite.append(text)
    return method, model, suite


def build_run_spec(suite_ref: str | os.PathLike[str], method_name: str, seed: int = 0,
                   out_dir: str | os.PathLike[str] | None = None,
                   overrides: Sequence[str] = (), model: str | None = None,
                   device: str = "auto", reuse_base_row: bool = True,
                   checkpoint_minutes: float = 15.0, joint: bool = False) -> RunSpec:
    """Everything one run needs, validated: suite (with overrides), method, model, seed."""
    method_sets, model_sets, suite_sets = split_overrides(overrides)
    path = resolve_suite(suite_ref)
    suite = load_suite(path, suite_sets)
    validate_suite_plugins(suite, _override_source(path, suite_sets))

    model_data = suite.model.model_dump()
    if model is not None:
        model_data["name"] = model
    model_data = apply_overrides(model_data, model_sets)
    model_spec = _validate_at(ModelSpec, model_data, "model")
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


__all__ = [
    "SUITE_PATH_ENV", "SuiteInfo", "SuiteNotFoundError", "apply_overrides", "build_run_spec",
    "default_out_dir", "list_suites", "load_suite", "method_settings",
    "method_settings_problems", "resolve_suite", "suite_dirs",
    "split_overrides", "validate_suite_plugins",
]
