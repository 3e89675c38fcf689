"""lm-eval task folders as clbench hands them to lm-eval: read safely, data paths resolved.

lm-eval resolves relative ``data_files`` against the working directory, not the YAML's folder, so
every folder of task YAMLs a probe brings (the shipped one, an ``include_path``, a task YAML's own
folder) is copied into a temporary folder with those paths made absolute first. lm-eval's
``!function`` tags are kept as opaque values on the round trip, never run. Running a probe is
:mod:`clbench.eval.lmeval`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from clbench.errors import UserError

if TYPE_CHECKING:
    from clbench.spec.schema import LmEvalProbe

SHIPPED_TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lmeval"
OFFLINE_TASK = "clbench_general_mc"


class LmEvalProbeError(UserError):
    """An lm-eval probe cannot run: unknown task, missing metric, unreadable task folder."""



class TaggedScalar:
    """A YAML node with a custom tag (lm-eval's `!function`), kept verbatim on a round trip."""

    def __init__(self, tag: str, value: str) -> None:
        self.tag, self.value = tag, value


class TaskYamlLoader(yaml.SafeLoader):
    """Safe loader that keeps tags such as lm-eval's `!function` as opaque values (never run)."""


class TaskYamlDumper(yaml.SafeDumper):
    """Safe dumper that writes those opaque tagged values back unchanged."""


TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: TaggedScalar(
    "!" + suffix, loader.construct_scalar(node)))
TaskYamlDumper.add_representer(
    TaggedScalar, lambda dumper, obj: dumper.represent_scalar(obj.tag, obj.value))


def _absolute(value: Any, folder: Path) -> Any:
    """Make a `data_files` value (str, list or split mapping) absolute against `folder`."""
    if isinstance(value, str):
        if "://" in value or Path(value).expanduser().is_absolute():
            return value
        return str((folder / value).resolve())
    if isinstance(value, list):
        return [_absolute(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: _absolute(v, folder) for k, v in value.items()}
    return value


def _read_yaml(path: Path, shown_as: Path | None = None) -> Any:
    """A task YAML, its custom tags kept opaque; invalid YAML is a user error naming the file."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=TaskYamlLoader)
    except yaml.YAMLError as exc:
        raise LmEvalProbeError(f"{shown_as or path}: not valid YAML: {exc}") from None


def resolve_task_folder(source: Path, dest: Path) -> list[str]:
    """Copy `source` (a folder of lm-eval YAMLs) to `dest` with relative data files resolved.

    Returns the task, group and tag names the folder's files name themselves. Helper modules
    (`!function utils.f`) and `include:` files keep working because the whole tree is copied.
    """
    if not source.is_dir():
        raise LmEvalProbeError(f"lm-eval include_path {source} is not a folder")
    shutil.copytree(source, dest, dirs_exist_ok=True)
    names: list[str] = []
    for path in sorted(dest.rglob("*.y*ml")):
        original = source / path.relative_to(dest)
        doc = _read_yaml(path, shown_as=original)
        if not isinstance(doc, dict):
            continue
        for key in ("task", "group", "tag"):  # a group's `task:` is its list of members
            value = doc.get(key)
            if isinstance(value, str):
                names.append(value)
            elif key == "tag" and isinstance(value, list):
                names += [v for v in value if isinstance(v, str)]
        kwargs = doc.get("dataset_kwargs")
        if isinstance(kwargs, dict) and "data_files" in kwargs:
            kwargs["data_files"] = _absolute(kwargs["data_files"], original.parent)
            path.write_text(yaml.dump(doc, Dumper=TaskYamlDumper, sort_keys=False),
                            encoding="utf-8")
    return names


@contextmanager
def prepared_tasks(probe: LmEvalProbe, base_dir: Path | None = None
                   ) -> Iterator[tuple[str, list[str], bool]]:
    """Yield (task name, include folders, whether lm-eval's built-in tasks are needed).

    The shipped folder is always included; ``probe.include_path`` and a task given as a YAML
    path are resolved against ``base_dir`` (the suite file's folder).
    """
    base = base_dir or Path.cwd()
    sources = [SHIPPED_TASK_DIR]
    task = probe.task
    if task.endswith((".yaml", ".yml")):
        yaml_path = _resolve(task, base)
        if not yaml_path.is_file():
            raise LmEvalProbeError(f"lm-eval task file {yaml_path} does not exist")
        doc = _read_yaml(yaml_path)
        doc = doc if isinstance(doc, dict) else {}
        # a group's `task:` lists its members; the group's own name is `group:`
        task = doc.get("group") if isinstance(doc.get("group"), str) else doc.get("task")
        if not isinstance(task, str):
            raise LmEvalProbeError(f"{yaml_path}: an lm-eval task YAML needs a `task:` name "
                                   "(a group YAML a `group:` name)")
        sources.append(yaml_path.parent)
    if probe.include_path:
        sources.append(_resolve(probe.include_path, base))
    with tempfile.TemporaryDirectory(prefix="clbench-lmeval-") as tmp:
        folders, known = [], []
        for i, src in enumerate(sources):
            dest = Path(tmp) / f"include{i}"
            known += resolve_task_folder(src, dest)
            folders.append(str(dest))
        yield task, folders, task not in known


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()

