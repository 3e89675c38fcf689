"""Reading specs: YAML files, validation errors as one readable message, `--set` overrides.

A user mistake in a suite file or an override becomes a :class:`SpecError` whose message names
the file and the field path (`stages[1].budget.steps`), never a traceback. YAML is read with
duplicate keys refused; an override is `path=value` with the value read as YAML. The models
themselves are :mod:`clbench.spec.schema`.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from clbench.errors import UserError


class SpecError(UserError, ValueError):
    """A user mistake in a spec file or override: one readable message, no traceback needed."""


def format_loc(loc: tuple[Any, ...]) -> str:
    """`('stages', 1, 'budget', 'steps')` -> `stages[1].budget.steps`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


_UNKNOWN_FIELD_HINT = "check the spelling; `clbench schema` lists the fields"


def describe_validation_error(err: Any, source: str, prefix: str = "",
                              unknown_field_hint: str = _UNKNOWN_FIELD_HINT) -> str:
    """Render a pydantic ValidationError as lines `source: prefix.field.path: what was expected`.

    `prefix` is where the validated object sits in a larger document (e.g. `method.params`);
    an empty `source` drops the leading `source: `.
    """
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field ({unknown_field_hint})"
        elif e["type"] == "missing":
            msg = "required field is missing"
        path = format_loc(loc) if loc else ""
        if prefix:
            path = prefix + (path if path.startswith("[") or not path else "." + path)
        where = path or "<root>"
        lines.append(f"{source}: {where}: {msg}" if source else f"{where}: {msg}")
    return "\n".join(lines)


class _SafeLoader(__import__("yaml").SafeLoader):
    """YAML safe loader that also rejects duplicate keys (a silent overwrite hides typos)."""


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    import yaml

    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_SafeLoader.add_constructor(
    __import__("yaml").resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> Any:
    """Read YAML with a safe loader; errors become :class:`SpecError` naming the file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # type: ignore[misc]  # how YAML errors name where they are
    try:
        return yaml.load(stream, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None


def validate_model(model: type[BaseModel], data: Any, source: str) -> Any:
    """Validate `data` against `model`, turning errors into one :class:`SpecError`."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_validation_error(err, source)) from None


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_path(path: str) -> list[str | int]:
    """`stages[0].budget.steps` -> `['stages', 0, 'budget', 'steps']`.

    Names are separated by dots, indices written `[N]`; anything else (`a..b`, `a.`, `[x]`,
    `a[0]b`) is an error that points at the offending part.
    """
    parts: list[str | int] = []
    pos = 0
    path = path.strip()
    if not path:
        raise SpecError("override key is empty; expected e.g. stages[0].budget.steps=4")
    while pos < len(path):
        if parts and path[pos] == ".":
            pos += 1
            if pos == len(path) or path[pos] in ".[":
                raise SpecError(f"override key {path!r}: expected a field name after the dot")
        elif parts and path[pos] != "[":
            raise SpecError(f"override key {path!r}: cannot parse near {path[pos:]!r}")
        m = _PATH_TOKEN.match(path, pos)
        if not m:
            raise SpecError(f"override key {path!r}: cannot parse near {path[pos:]!r} "
                            "(indices are written [N] with N >= 0)")
        parts.append(m.group(1).strip() if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if isinstance(parts[0], int):
        raise SpecError(f"override key {path!r}: must start with a field name")
    return parts


def parse_override(text: str, example: str = "stages[0].budget.steps=4"
                   ) -> tuple[list[str | int], Any]:
    """`key.path=value` -> (path parts, YAML-typed value). `=1e-5` becomes a float; a value
    YAML cannot read because it starts with a character YAML reserves (`*` in
    `operators=*`) is the string as written."""
    import yaml

    if "=" not in text:
        raise SpecError(f"override {text!r}: expected KEY=VALUE, e.g. {example}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_SafeLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        if raw.strip()[0] not in "*&@`%":
            raise SpecError(f"override {text!r}: value is not valid YAML (a string may be "
                            f"quoted: --set '{key}=\"...\"'): {exc}") from None
        value = raw
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value.strip()):
        value = float(value)  # YAML 1.1 reads `1e-5` as a string; users mean a number
    return parse_path(key), value


def apply_override(data: dict, path: list[str | int], value: Any) -> None:
    """Set `value` at `path` inside nested dicts/lists, creating mappings as needed.

    Indices must point at existing list items; a missing (or null) mapping on the way is
    created, so `model.revision=main` works whether or not the file has a `model:` section.
    """
    full = format_loc(tuple(path))
    node: Any = data
    for i, part in enumerate(path):
        parent = format_loc(tuple(path[:i])) if i else "the document"
        last = i == len(path) - 1
        if isinstance(part, int):
            if not isinstance(node, list):
                raise SpecError(f"override {full}: {parent} is not a list, it cannot be indexed "
                                f"with [{part}]")
            if part >= len(node):
                raise SpecError(f"override {full}: {format_loc(tuple(path[:i + 1]))} does not "
                                f"exist ({parent} has {len(node)} items, indices start at 0)")
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            if not isinstance(node, dict):
                raise SpecError(f"override {full}: {parent} is not a mapping, it has no field "
                                f"{part!r}")
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # an absent or null section (e.g. `lm_eval: null`)
                    node[part] = {}
                node = node[part]
