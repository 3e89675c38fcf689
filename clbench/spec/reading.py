"""Reading specs: YAML files, validation errors as one readable message, `--set` overrides.

A user mistake in a suite file or an override becomes a :class:`SpecError` whose message names
the file, the field path (`stages[1].budget.steps`) and, for a file, its line and column, never a
traceback. YAML is read safely (no tags that build objects), with duplicate keys refused, and
bounded before it is built: a file over :data:`MAX_SPEC_BYTES`, or one whose aliases would expand
to more than :data:`MAX_SPEC_NODES` values or nest deeper than :data:`MAX_SPEC_DEPTH` (the
"billion laughs"), is refused in milliseconds. An override is `path=value` with the value read as
YAML. The models themselves are :mod:`clbench.spec.schema`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from clbench.errors import UserError
from clbench.text import printable


class SpecError(UserError, ValueError):
    """A user mistake in a spec file or override: one readable message, no traceback needed."""


#: The largest spec file read: a suite is a few kilobytes (the shipped ones under 10 KB).
MAX_SPEC_BYTES = 1 << 20
#: The most values (mappings, lists, scalars) a spec may hold with its aliases followed.
MAX_SPEC_NODES = 100_000
#: The deepest nesting of mappings and lists a spec may have.
MAX_SPEC_DEPTH = 64

#: What the whole document is called where an error has no field path.
TOP_LEVEL = "the top level"


def format_loc(loc: tuple[Any, ...]) -> str:
    """`('stages', 1, 'budget', 'steps')` -> `stages[1].budget.steps`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or TOP_LEVEL


_UNKNOWN_FIELD_HINT = "check the spelling; `clbench schema` lists the fields"

#: Regular expressions of the schema, as a sentence says them.
PATTERN_WORDS = {
    r"^[a-z0-9][a-z0-9_.\-]*$": "lowercase letters, digits, '_', '.' and '-', starting with a "
                                "letter or digit",
    r"^(auto|cpu|mps|cuda(:\d+)?)$": "auto, cpu, mps, cuda or cuda:N",
}


def plain_message(error: dict[str, Any], unknown_field_hint: str = _UNKNOWN_FIELD_HINT) -> str:
    """Pydantic's message for one error, in a sentence a user reads without pydantic's terms:
    no "Value error, " prefix, patterns said in words, the input shown where it helps."""
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"unknown field ({unknown_field_hint})"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        pattern = (error.get("ctx") or {}).get("pattern", "")
        words = PATTERN_WORDS.get(pattern, f"the form {pattern}")
        return f"{error.get('input')!r} is not allowed here: expected {words}"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "assertion_error":
        return msg.removeprefix("Assertion failed, ")
    return msg


def describe_validation_error(err: Any, source: str, prefix: str = "",
                              unknown_field_hint: str = _UNKNOWN_FIELD_HINT,
                              where: Callable[[tuple[Any, ...]], str | None] | None = None
                              ) -> str:
    """Render a pydantic ValidationError as lines `source: prefix.field.path: what was expected`.

    `prefix` is where the validated object sits in a larger document (e.g. `method.params`);
    an empty `source` drops the leading `source: `. `where` gives a field path's place in the
    file (:meth:`YamlDocument.where`), shown after the path.
    """
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = plain_message(e, unknown_field_hint)
        path = format_loc(loc) if loc else ""
        if prefix:
            path = prefix + (path if path.startswith("[") or not path else "." + path)
        place = where(loc) if where is not None else None
        at = (path or TOP_LEVEL) + (f" ({place})" if place else "")
        lines.append(f"{source}: {at}: {msg}" if source else f"{at}: {msg}")
    return "\n".join(lines)


class _SafeLoader(__import__("yaml").SafeLoader):
    """YAML safe loader that also rejects duplicate keys (a silent overwrite hides typos)."""


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    import yaml

    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):  # `[a]: 1`, `{a: 1}: 2`: not a name
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a name or a number, not a {type(key).__name__}",
                key_node.start_mark)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_SafeLoader.add_constructor(
    __import__("yaml").resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class YamlDocument:
    """A YAML file's data and its node tree, which knows where each value was written."""

    data: Any
    root: Any  # yaml.Node, or None for an empty file

    def where(self, loc: tuple[Any, ...]) -> str | None:
        """`line L, column C` of the value at field path `loc` (or of the deepest part of it
        written in the file: a missing field points at its mapping), None when not found."""
        import yaml

        if not loc:  # the whole file: a place says nothing
            return None
        node, found = self.root, None
        for part in loc:
            if node is None:
                break
            found = node
            if isinstance(node, yaml.MappingNode) and isinstance(part, str):
                node = next((v for k, v in node.value
                             if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                    and 0 <= part < len(node.value):
                node = node.value[part]
            else:
                node = None
        node = node if node is not None else found
        if node is None:
            return None
        mark = node.start_mark
        return f"line {mark.line + 1}, column {mark.column + 1}"


def placed(problems: list[str], source: str) -> list[str]:
    """`source: field.path: message` lines with each field's line and column in the file
    `source` added after its path (`source: field.path (line L, column C): message`); lines
    of another form, or when `source` is not a readable spec file, as they are."""
    lead = f"{source}: "
    try:
        document = read_yaml_document(source) if Path(source).is_file() else None
    except (SpecError, OSError):
        document = None
    if document is None:
        return problems
    out = []
    for line in problems:
        field, sep, message = line[len(lead):].partition(": ")
        place = None
        if line.startswith(lead) and sep and re.fullmatch(r"[\w.\[\]-]+", field):
            try:
                place = document.where(tuple(parse_path(field)))
            except SpecError:
                place = None
        out.append(f"{lead}{field} ({place}): {message}" if place else line)
    return out


def read_yaml(path: str | Path) -> Any:
    """Read YAML with a safe loader; errors become :class:`SpecError` naming the file."""
    return read_yaml_document(path).data


def read_yaml_document(path: str | Path) -> YamlDocument:
    """Read a YAML file (safe loader, duplicate keys refused, size, expansion and depth
    bounded), keeping its nodes for :meth:`YamlDocument.where`; errors become
    :class:`SpecError` naming the file."""
    import yaml

    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES // 1024} KiB, too large for a spec "
                        "file (a suite is a few kilobytes); is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: cannot read: not UTF-8 text ({exc})") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # type: ignore[misc]  # how YAML errors name where they are
    loader = _SafeLoader(stream)
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_expansion(root, path)
            data = loader.construct_document(root)
        else:
            data = None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to be a spec file (more than "
                        f"{MAX_SPEC_DEPTH} levels)") from None
    finally:
        loader.dispose()
    return YamlDocument(printable(data), root)


def _check_expansion(root: Any, path: Path) -> None:
    """Refuse a node graph whose aliases expand past :data:`MAX_SPEC_NODES` values, nest past
    :data:`MAX_SPEC_DEPTH`, or refer to themselves: counted on the graph, with each node's
    expanded size computed once, so the check is linear in the file, not in the expansion."""
    import yaml

    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if isinstance(node, yaml.ScalarNode):
            sizes[key], depths[key] = 1, 0
            continue
        children = [n for pair in node.value for n in pair] \
            if isinstance(node, yaml.MappingNode) else list(node.value)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
            if sizes[key] > MAX_SPEC_NODES:
                raise SpecError(f"{path}: its aliases (*name) expand to more than "
                                f"{MAX_SPEC_NODES:,} values, too many for a spec file")
            if depths[key] > MAX_SPEC_DEPTH:
                raise SpecError(f"{path}: nested more than {MAX_SPEC_DEPTH} levels deep, too "
                                "deep for a spec file")
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise SpecError(f"{path}: line {node.start_mark.line + 1}: an alias refers to a "
                            "value that contains it; a spec cannot be recursive")
        open_nodes.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_nodes:
                raise SpecError(f"{path}: line {child.start_mark.line + 1}: an alias refers to "
                                "a value that contains it; a spec cannot be recursive")
            if id(child) not in sizes:
                stack.append((child, False))


def validate_model(model: type[BaseModel], data: Any, source: str,
                   document: YamlDocument | None = None) -> Any:
    """Validate `data` against `model`, turning errors into one :class:`SpecError` (with the
    line and column of each field in `document`, the file `data` was read from)."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_validation_error(
            err, source, where=document.where if document is not None else None)) from None


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
