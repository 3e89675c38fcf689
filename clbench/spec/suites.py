"""Finding suites by name or path and applying `--set` overrides.

A suite is named by its file stem (`starter` -> `suites/starter.yaml`) or given as a path.
Names are looked up in the folders of the `CLBENCH_SUITE_PATH` environment variable (separated
like `PATH`), then in the suites shipped with clbench; the first match wins.

Overrides are `KEY=VALUE` strings. :func:`split_overrides` routes them: keys under `method.` are
method parameters, keys under `addon.NAME.` an add-on's, keys under `model.` change the run's
model, and every other key edits the suite (`stages[0].budget.steps=4`). Whatever the route,
the result is validated exactly like a file, and errors name the file, the override, the field
path and what was expected. A run's whole spec, with the plugins' parameters checked, is built
in :mod:`clbench.plugins.runspec`.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from clbench import migrations
from clbench.errors import UserError
from clbench.spec.reading import (
    SpecError,
    YamlDocument,
    apply_override,
    parse_override,
    read_yaml,
    read_yaml_document,
    validate_model,
)
from clbench.spec.schema import LmEvalProbe, SuiteSpec, TaskSpec
from clbench.spec.taskfile import read_task_file

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
        try:
            key = d.resolve()
            found = d.is_dir()
        except (OSError, RuntimeError):  # a symlink loop, a folder that cannot be reached
            continue
        if key not in seen and found:
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


def override_source(path: Path, overrides: Sequence[str]) -> str:
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
    document = read_yaml_document(path)
    if not isinstance(document.data, dict):
        raise SpecError(f"{path}: expected a mapping of suite fields at the top level, got "
                        f"{type(document.data).__name__}")
    data = apply_overrides(migrations.suite(document.data), overrides)
    source = override_source(path, overrides)
    suite = validate_model(SuiteSpec, data, source, _OverriddenDocument(document, overrides))
    read_task_files(suite, path.parent, source)
    return suite


def read_task_files(suite: SuiteSpec, folder: Path, source: str) -> None:
    """Fill in the content of every task file a task names (`source: tasks/x.yaml`, relative to
    `folder`, the suite file's): what it holds, with its data's SHA-256, is then part of the
    suite's hash. Every task also learns `folder`, which its relative `data_files` resolve
    against. Every problem is reported at once, each with its field path."""
    problems = []
    tasks = [(f"stages[{i}].task", s.task) for i, s in enumerate(suite.stages)]
    tasks += [(f"probes[{i}].task", p.task) for i, p in enumerate(suite.probes) if p.task]
    for where, task in tasks:
        if task.definition is not None or task.folder is not None or \
                task.suite_folder is not None:
            problems.append(f"{where}: definition, folder and suite_folder are filled in when "
                            "the suite is read; remove them")
            continue
        task.suite_folder = str(folder.resolve())
        if task.is_file:
            try:
                read_task_file_of(task, folder)
            except SpecError as exc:
                problems += [f"{where}.source: {line}" for line in str(exc).splitlines()]
    if problems:
        raise SpecError("\n".join(f"{source}: {line}" for line in problems))


class _OverriddenDocument(YamlDocument):
    """A suite file's document that places no field an override set (its value is not the
    file's)."""

    def __init__(self, document: YamlDocument, overrides: Sequence[str]) -> None:
        super().__init__(document.data, document.root)
        object.__setattr__(self, "overridden",
                           [tuple(parse_override(text)[0]) for text in overrides])

    def where(self, loc: tuple[Any, ...]) -> str | None:
        if any(loc[:len(path)] == path for path in self.overridden):
            return None
        return super().where(loc)


def read_task_file_of(task: TaskSpec, folder: Path) -> None:
    """Fill in `task`'s definition from the task file its source names (a relative path against
    `folder`) and its folder."""
    path = Path(task.source).expanduser()
    path = path if path.is_absolute() else folder / path
    task.definition = read_task_file(path)
    task.folder = str(path.resolve().parent)


def method_settings(suite: SuiteSpec, method: str, overrides: Sequence[str] = ()
                    ) -> dict[str, Any]:
    """The parameters a run of `method` gets: the suite's `methods.<method>` block, then the
    `--set method.X` overrides (prefix removed) on top."""
    return apply_overrides(suite.methods.get(method, {}), overrides)


def default_out_dir(suite_name: str, method: str, seed: int) -> str:
    """Where a run's results go unless `--out` says otherwise: `runs/<suite>/<method>/s<seed>`,
    `<method>` naming the add-ons too (`sdpo+ewc`; a method named by its location,
    `package.module:Class`, in a folder `package.module.Class`). A name that would leave
    `runs/` (a path separator, `..`) is refused: names come from plugins and files."""
    parts = [suite_name, method.replace(":", ".")]
    for part in parts:
        if not part or part in (".", "..") or any(sep in part for sep in ("/", "\\", "\0")):
            raise SpecError(f"{part!r} cannot name a run folder (it would lead out of runs/); "
                            "pass --out")
    return str(Path("runs", *parts, f"s{seed}"))


def probe_task_folders(probe: LmEvalProbe, base_dir: Path | None = None) -> list[Path]:
    """The folders an lm-eval probe brings (a task YAML's folder, `include_path`), relative
    paths resolved against `base_dir` (the suite file's folder; the working folder without
    one)."""
    base = base_dir or Path.cwd()

    def resolve(path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    folders = []
    if probe.task.endswith((".yaml", ".yml")):
        folders.append(resolve(probe.task).parent)
    if probe.include_path:
        folders.append(resolve(probe.include_path))
    return folders


def task_code(probe: LmEvalProbe, base_dir: Path | None = None) -> list[Path]:
    """The files of the folders a probe brings through which lm-eval would run Python: `.py`
    modules (a task's `!function utils.x` imports them) and task YAMLs with a `!function` tag.
    A folder of plain YAML and data runs none."""
    found: list[Path] = []
    for folder in probe_task_folders(probe, base_dir):
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*")):
            if path.is_file() and (path.suffix == ".py" or (
                    path.suffix in (".yaml", ".yml") and b"!function" in path.read_bytes())):
                found.append(path)
    return found


class RoutedOverrides(NamedTuple):
    """`--set` overrides by what they change, each with its routing prefix removed."""

    method: list[str]              # `method.X=V` as `X=V`
    model: list[str]               # `model.X=V` as `X=V`
    addons: dict[str, list[str]]   # `addon.NAME.X=V` as `X=V`, by add-on name
    suite: list[str]               # everything else, as given


def split_overrides(overrides: Sequence[str]) -> RoutedOverrides:
    """Route overrides: `method.*`, `model.*` and `addon.NAME.*` with their prefix removed, the
    rest (suite fields) as given."""
    routed = RoutedOverrides([], [], {}, [])
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        head, _, rest = key.partition(".")
        if head in ("method", "model", "addon") and rest:
            if "=" not in text:  # said here: past this point the prefix is gone
                raise SpecError(f"override {text!r}: expected KEY=VALUE, e.g. "
                                f"{key}={'1e-5' if key == 'method.lr' else '...'}")
            if head == "addon":
                name, _, field = rest.partition(".")
                if not field:
                    raise SpecError(f"override {text!r}: name the add-on and the field, e.g. "
                                    "addon.replay.fraction=0.5")
                routed.addons.setdefault(name, []).append(text.strip()[len(f"addon.{name}."):])
            else:
                getattr(routed, head).append(text.strip()[len(head) + 1:])
        elif key in ("method", "model", "addon"):
            example = {"method": "lr=1e-5", "model": "dtype=float32",
                       "addon": "replay.fraction=0.5"}[key]
            raise SpecError(f"override {text!r}: set one field at a time, e.g. {key}.{example}")
        else:
            routed.suite.append(text)
    return routed


__all__ = [
    "SUITE_PATH_ENV",
    "RoutedOverrides",
    "SuiteInfo",
    "SuiteNotFoundError",
    "apply_overrides",
    "default_out_dir",
    "list_suites",
    "load_suite",
    "method_settings",
    "override_source",
    "resolve_suite",
    "split_overrides",
    "suite_dirs",
]
