"""Plugin discovery: methods, add-ons and task sources found through Python entry points.

Built-in plugins register in the `clbench.methods`, `clbench.addons` and `clbench.tasks` groups
exactly like third-party packages do, so `pip install` is all it takes to add one. This module
finds them, loads them lazily (a plugin that fails to import only breaks when it is used),
validates their parameters against their own config models, and turns every mistake into a
:class:`PluginError` that names what is known, what was meant and which distribution is at fault.

A method can also be named by where it is, `package.module:Class` (`clbench run --method
my_pkg.method:MyMethod`): a class in development runs without an entry point, with the same
checks. Only a name the user typed may be one (:func:`allow_location`, which the command line
calls for `--method`): a name read from a suite, a results file or a run folder resolves
through the installed entry points alone, so no file makes clbench import a module. A plugin's
config (or a task source's parameters) must document every field: the descriptions are its
command-line help.

Tests swap the entry-point source with :func:`using_entry_points` (whole replacement) or
:func:`extra_plugins` (fakes on top of what is installed); both clear the caches on entry and exit.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from clbench.errors import UserError
from clbench.spec.reading import SpecError, describe_validation_error

if TYPE_CHECKING:
    from clbench.spec.schema import AddOnSpec, MethodSpec, RunSpec, TaskSpec
    from clbench.tasks.base import TaskParams, TaskSource
    from clbench.train.addons import AddOn, AddOnConfig
    from clbench.train.api import Method, MethodConfig

METHODS_GROUP = "clbench.methods"
TASKS_GROUP = "clbench.tasks"
ADDONS_GROUP = "clbench.addons"
GROUPS = (METHODS_GROUP, TASKS_GROUP, ADDONS_GROUP)
_KIND = {METHODS_GROUP: "method", TASKS_GROUP: "task source", ADDONS_GROUP: "add-on"}
_LIST_HINT = {METHODS_GROUP: "clbench list methods", TASKS_GROUP: "clbench list tasks",
              ADDONS_GROUP: "clbench list addons"}


class PluginError(UserError):
    """A plugin cannot be used: unknown name, name clash, failed import, wrong kind of object.

    `reason` is the short cause (e.g. the import error) for listings that already show the name.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


@dataclass
class PluginInfo:
    """One registered plugin as `clbench list` shows it."""

    name: str
    group: str
    value: str                     # the entry point's target, `module:attribute`
    distribution: str | None       # the installed distribution that declares it
    description: str
    details: dict[str, str] = field(default_factory=dict)  # tasks: domain, origin, license
    load_error: str | None = None  # set when the plugin cannot be loaded


@dataclass(frozen=True)
class StaticEntryPoint:
    """An entry point whose target is an object already in memory (for tests and notebooks).

    `error`, when given, is raised by :meth:`load` in place of returning `target`, which is how
    a test simulates a plugin whose import fails; `target_path` then says what it would import.
    """

    name: str
    group: str
    target: Any = None
    distribution: str = "test-plugins"
    error: BaseException | None = None
    target_path: str | None = None

    @property
    def value(self) -> str:
        if self.target_path is not None:
            return self.target_path
        module = getattr(self.target, "__module__", "?")
        return f"{module}:{getattr(self.target, '__qualname__', repr(self.target))}"

    @property
    def dist(self) -> Any:
        return _NamedDist(self.distribution)

    def load(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.target


@dataclass(frozen=True)
class _NamedDist:
    name: str


EntryPointSource = Callable[[str], Iterable[Any]]


def _installed_entry_points(group: str) -> Iterable[Any]:
    return importlib.metadata.entry_points(group=group)


_source: EntryPointSource = _installed_entry_points
_entries: dict[str, dict[str, list[Any]]] = {}
_loaded: dict[tuple[str, str], type] = {}
_allowed_locations: set[str] = set()  # `package.module:Class` names the user typed


def allow_location(name: str) -> None:
    """Let method `name`, when it is a location (`package.module:Class`), be imported from
    there: for a name the user gave on the command line (or in code), never one read from a
    file."""
    if _is_location(METHODS_GROUP, name):
        _allowed_locations.add(name)


def clear_cache() -> None:
    """Forget discovered entry points, loaded classes and the locations allowed so far (after
    installing a plugin)."""
    _entries.clear()
    _loaded.clear()
    _allowed_locations.clear()


@contextmanager
def using_entry_points(source: EntryPointSource) -> Iterator[None]:
    """Discover plugins from `source(group) -> entry points` instead of the installed ones."""
    global _source
    previous = _source
    _source = source
    clear_cache()
    try:
        yield
    finally:
        _source = previous
        clear_cache()


@contextmanager
def extra_plugins(methods: Mapping[str, type] | None = None,
                  tasks: Mapping[str, type] | None = None,
                  distribution: str = "test-plugins",
                  addons: Mapping[str, type] | None = None) -> Iterator[None]:
    """Add in-memory plugins on top of the current ones for the duration of the block."""
    base = _source
    added = {METHODS_GROUP: dict(methods or {}), TASKS_GROUP: dict(tasks or {}),
             ADDONS_GROUP: dict(addons or {})}

    def source(group: str) -> list[Any]:
        extra = [StaticEntryPoint(name, group, target, distribution)
                 for name, target in added.get(group, {}).items()]
        return [*base(group), *extra]

    with using_entry_points(source):
        yield


# ---------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------

def _dist_name(entry_point: Any) -> str | None:
    dist = getattr(entry_point, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


def _dist_version(entry_point: Any) -> str | None:
    dist = getattr(entry_point, "dist", None)
    version = getattr(dist, "version", None) if dist is not None else None
    return str(version) if version is not None else None


@dataclass(frozen=True)
class Origin:
    """Where a plugin came from, as results record it."""

    distribution: str | None  # the installed distribution that declares (or holds) it
    version: str | None       # that distribution's version
    target: str               # `module:attribute`
    # the commit (`+dirty` with local changes) of the git checkout holding the plugin's module,
    # None outside one: an editable install or a PYTHONPATH entry runs whatever is checked out
    # there, which the distribution's version does not tell
    source_revision: str | None = None


class _PathEntryPoint:
    """A method named by its location (`package.module:Class`) instead of an entry point."""

    def __init__(self, name: str, group: str) -> None:
        self.name = self.value = name
        self.group = group
        top = name.split(":", 1)[0].split(".", 1)[0]
        dists = importlib.metadata.packages_distributions().get(top, [])
        self.dist = importlib.metadata.distribution(dists[0]) if dists else None

    def load(self) -> Any:
        import importlib

        module, _, attribute = self.name.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
        return obj


def _is_location(group: str, name: str) -> bool:
    """`package.module:Class`, which only methods may be named by."""
    module, _, attribute = name.partition(":")
    return (group == METHODS_GROUP and bool(module) and bool(attribute)
            and all(p.isidentifier() for p in module.split(".") + attribute.split(".")))


def _candidates(group: str, name: str) -> list[Any]:
    found = _group_entries(group).get(name)
    if not found and name in _allowed_locations and _is_location(group, name):
        return [_PathEntryPoint(name, group)]
    return found or []


def _group_entries(group: str) -> dict[str, list[Any]]:
    """Entry points of `group` by name; a name declared by two distributions keeps both."""
    if group not in GROUPS:
        raise ValueError(f"unknown plugin group {group!r}; expected one of {GROUPS}")
    if group not in _entries:
        by_name: dict[str, list[Any]] = {}
        for ep in _source(group):
            same = by_name.setdefault(ep.name, [])
            # One distribution seen twice on sys.path (e.g. an editable install plus a stale
            # egg-info) is the same plugin, not a clash.
            if not any(_dist_name(o) == _dist_name(ep) and o.value == ep.value for o in same):
                same.append(ep)
        _entries[group] = dict(sorted(by_name.items()))
    return _entries[group]


def plugin_names(group: str) -> list[str]:
    """Sorted names registered in `group`."""
    return list(_group_entries(group))


def _unknown_name_error(group: str, name: str) -> PluginError:
    known = plugin_names(group)
    kind = _KIND[group]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listing = ", ".join(known) if known else "none are installed"
    if _is_location(group, name):  # not typed by the user: a file named it
        hint += (" A method named by its location (package.module:Class) is imported only "
                 "when given to --method, never when a file names it.")
    return PluginError(f"unknown {kind} {name!r}.{hint} Known {kind}s: {listing} "
                       f"(see `{_LIST_HINT[group]}`).")


def _load_class(group: str, name: str) -> type:
    key = (group, name)
    if key in _loaded:
        return _loaded[key]
    candidates = _candidates(group, name)
    if not candidates:
        raise _unknown_name_error(group, name)
    kind = _KIND[group]
    if len(candidates) > 1:
        who = " and ".join(f"{_dist_name(ep) or '?'} ({ep.value})" for ep in candidates)
        raise PluginError(f"{kind} {name!r} is registered by more than one distribution: {who}. "
                          "Uninstall one of them.")
    ep = candidates[0]
    dist = _dist_name(ep) or "an unknown distribution"
    try:
        obj = ep.load()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        # An entry point naming a module or class that is not there usually means the
        # distribution's metadata is older than its code (an editable install after a move).
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        module = ep.value.split(":")[0]
        stale = isinstance(exc, AttributeError) or bool(missing and module.startswith(missing))
        hint = f"; if {dist} is installed in editable mode, reinstall it (pip install -e ...)" \
            if stale else ""
        raise PluginError(f"{kind} {name!r} from distribution {dist} failed to import "
                          f"({ep.value}): {reason}{hint}", reason=reason) from exc
    expected = _base_class(group)
    if not (isinstance(obj, type) and issubclass(obj, expected)):
        reason = (f"{ep.value} is not a subclass of {expected.__module__}."
                  f"{expected.__qualname__}")
        raise PluginError(f"{kind} {name!r} from distribution {dist}: {reason}.", reason=reason)
    reason = _training_problem(obj) if group == METHODS_GROUP else None
    if reason is not None:
        reason = f"{ep.value} {reason}"
        raise PluginError(f"{kind} {name!r} from distribution {dist}: {reason}.", reason=reason)
    undocumented = _undocumented_fields(group, obj)
    if undocumented:
        reason = (f"{ep.value}: {'field' if len(undocumented) == 1 else 'fields'} "
                  f"{', '.join(undocumented)} of its {_PARAMS_ATTR[group]} "
                  f"{'has' if len(undocumented) == 1 else 'have'} no description (give each "
                  "field `Field(description=...)`: it is the command-line help)")
        raise PluginError(f"{kind} {name!r} from distribution {dist}: {reason}.", reason=reason)
    _loaded[key] = obj
    return obj


_PARAMS_ATTR = {METHODS_GROUP: "Config", TASKS_GROUP: "Params", ADDONS_GROUP: "Config"}


def _training_problem(cls: type) -> str | None:
    """What keeps a method class from training: neither step hooks nor a stage of its own, or
    step hooks for the shared loop without the loop's optimizer settings in its config."""
    from clbench.train.api import Method
    from clbench.train.optim import OptimizerSettings

    own_hooks = cls.hooks is not Method.hooks  # type: ignore[attr-defined]
    own_stage = cls.train_stage is not Method.train_stage  # type: ignore[attr-defined]
    if not own_hooks and not own_stage:
        return "implements neither hooks(ctx) nor train_stage(ctx)"
    config = getattr(cls, "Config", None)
    if own_hooks and not own_stage and not (isinstance(config, type)
                                            and issubclass(config, OptimizerSettings)):
        return ("gives hooks(ctx) to the shared training loop, but its Config does not "
                "inherit OptimizerSettings (the loop's optimizer fields)")
    return None


def _undocumented_fields(group: str, cls: type) -> list[str]:
    """Fields of the plugin's config (a task source's params) without a description."""
    model = getattr(cls, _PARAMS_ATTR[group], None)
    fields = getattr(model, "model_fields", {}) if isinstance(model, type) else {}
    return [name for name, info in fields.items() if not (info.description or "").strip()]


def plugin_origin(group: str, name: str) -> Origin:
    """The distribution (and its version) that `name` in `group` comes from."""
    cls = _load_class(group, name)  # a plugin that cannot be used has no origin to record
    ep = _candidates(group, name)[0]
    return Origin(_dist_name(ep), _dist_version(ep), ep.value, _source_revision(cls))


def _source_revision(cls: type) -> str | None:
    from clbench.results import git_revision

    try:
        where = Path(inspect.getfile(cls)).resolve().parent
    except (TypeError, OSError):  # defined interactively or in a built-in module
        return None
    return git_revision(where)


def _base_class(group: str) -> type:
    if group == METHODS_GROUP:
        from clbench.train.api import Method

        return Method
    if group == ADDONS_GROUP:
        from clbench.train.addons import AddOn

        return AddOn
    from clbench.tasks.base import TaskSource

    return TaskSource


def _first_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def list_plugins(group: str) -> list[PluginInfo]:
    """Every plugin of `group`, sorted by name; plugins that fail to load are listed too."""
    infos: list[PluginInfo] = []
    for name, candidates in _group_entries(group).items():
        try:
            cls = _load_class(group, name)
        except PluginError as exc:
            for ep in candidates:
                infos.append(PluginInfo(name, group, ep.value, _dist_name(ep),
                                        f"(import failed: {exc.reason})" if len(candidates) == 1
                                        else f"(conflict: {exc})", load_error=str(exc)))
            continue
        ep = candidates[0]
        description = _first_line(getattr(cls, "description", None) or cls.__doc__)
        details: dict[str, str] = {}
        if group == TASKS_GROUP:
            details = {attr: str(getattr(cls, attr, "")) for attr in ("domain", "origin",
                                                                      "license")}
        infos.append(PluginInfo(name, group, ep.value, _dist_name(ep), description, details))
    return infos


def load_method_class(name: str) -> type[Method]:
    """The method class registered as `name` in `clbench.methods` (or at `package.module:Class`)."""
    return _load_class(METHODS_GROUP, name)


def load_task_class(name: str) -> type[TaskSource]:
    """The task source class registered as `name` in `clbench.tasks`."""
    return _load_class(TASKS_GROUP, name)


def load_addon_class(name: str) -> type[AddOn]:
    """The add-on class registered as `name` in `clbench.addons`."""
    return _load_class(ADDONS_GROUP, name)


# ---------------------------------------------------------------------------------------------
# Parameters and construction
# ---------------------------------------------------------------------------------------------

def _validate_params(model: type[BaseModel], params: Any, where: str, listed_by: str) -> Any:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise SpecError(f"{where}: expected a mapping of parameters, got "
                        f"{type(params).__name__}")
    try:
        return model.model_validate(params)
    except ValidationError as err:
        hint = f"check the spelling; `{listed_by}` lists them"
        raise SpecError(describe_validation_error(err, source="", prefix=where,
                                                  unknown_field_hint=hint)) from None


def validate_method_params(name: str, params: dict[str, Any] | None,
                           where: str = "method.params") -> MethodConfig:
    """Validate `params` against method `name`'s `Config`; errors carry `where.field`."""
    return _validate_params(load_method_class(name).Config, params, where,
                            f"clbench methods show {name}")


def task_class(spec: TaskSpec) -> type[TaskSource]:
    """The task source class of `spec`: a task file's (its content was read with the suite) or
    the class registered under its name."""
    if spec.definition is not None:
        from clbench.tasks.declared import declared_task_class

        return declared_task_class(spec.definition, spec.folder or ".")
    if spec.is_file:
        raise SpecError(f"{spec.source}: a task file is read with the suite that names it "
                        "(relative to the suite file)")
    return load_task_class(spec.source)


def validate_task_params(spec: TaskSpec, where: str = "task.params") -> TaskParams:
    """Validate the task's `params` against its source's `Params`, relative `data_files`
    anchored at the suite's folder; errors carry `where.field`."""
    return _validate_params(task_class(spec).Params, _anchored(spec.params, spec.suite_folder),
                            where, f"clbench tasks show {spec.source}")


def _anchored(params: Any, folder: str | None) -> Any:
    """`params` with relative paths in `data_files` (a path, a list, a mapping of either) made
    absolute against `folder`, the suite file's: written in a suite, they mean files beside
    it, wherever the command runs."""
    if folder is None or not isinstance(params, dict) or "data_files" not in params:
        return params

    def anchor(value: Any) -> Any:
        if isinstance(value, str):
            path = Path(value).expanduser()
            return value if path.is_absolute() else str(Path(folder) / path)
        if isinstance(value, list):
            return [anchor(v) for v in value]
        if isinstance(value, dict):
            return {k: anchor(v) for k, v in value.items()}
        return value

    return {**params, "data_files": anchor(params["data_files"])}


def build_method(spec: MethodSpec, where: str = "method.params") -> Method:
    """Instantiate the method of `spec` with its validated config."""
    config = validate_method_params(spec.name, spec.params, where)
    return load_method_class(spec.name)(config)


def _config_defaults(group: str, name: str) -> dict[str, Any] | None:
    """The config of plugin `name` (a method or an add-on) at its defaults, as JSON; None when a
    field has no default."""
    config = _load_class(group, name).Config  # type: ignore[attr-defined]
    try:
        return config().model_dump(mode="json")
    except ValidationError:
        return None


def run_defaults(run: RunSpec) -> list[dict[str, Any] | None]:
    """The configs at their defaults of the run's method, then of each of its add-ons: what its
    results record so that a report tells its settings apart without importing a plugin."""
    return [_config_defaults(METHODS_GROUP, run.method.name)] + \
        [_config_defaults(ADDONS_GROUP, a.name) for a in run.addons]


def validate_addon_params(name: str, params: dict[str, Any] | None,
                          where: str = "addons") -> AddOnConfig:
    """Validate `params` against add-on `name`'s `Config`; errors carry `where.field`."""
    return _validate_params(load_addon_class(name).Config, params, where,
                            f"clbench addons show {name}")


def build_addons(specs: Sequence[AddOnSpec]) -> list[AddOn]:
    """The run's add-ons, in order, each with its validated config."""
    return [load_addon_class(s.name)(validate_addon_params(s.name, s.params,
                                                           f"addon.{s.name}"))
            for s in specs]


def build_task(spec: TaskSpec, where: str = "stages[0].task.params") -> TaskSource:
    """Instantiate the task source of `spec` with its validated parameters."""
    params = validate_task_params(spec, where)
    cls = task_class(spec)
    try:
        return cls(params)
    except ValueError as exc:
        # A source may check combinations of parameters its model cannot express.
        raise SpecError(f"{where}: {exc}") from None
