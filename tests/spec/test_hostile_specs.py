"""Hostile and malformed suite files: refused fast, with the file, the field and its place, in
plain words; never a traceback, never unbounded time or memory (property-based for any input)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clbench.cli import cli
from clbench.spec.reading import MAX_SPEC_BYTES, SpecError
from clbench.spec.schema import MAX_ITEMS
from clbench.spec.suites import load_suite, resolve_suite

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi")) + "name: t\ndescription: *i\n"  # 10^9 values


def _refused(path: Path, match: str) -> float:
    started = time.perf_counter()
    with pytest.raises(SpecError, match=match) as info:
        load_suite(path)
    assert str(info.value).startswith(str(path))
    return time.perf_counter() - started


def test_aliases_that_expand_exponentially_are_refused_at_once(write_suite) -> None:
    path = write_suite(LAUGHS)
    assert _refused(path, "aliases .* expand to more than 100,000 values") < 1.0


def test_a_recursive_alias_and_deep_nesting_are_refused(write_suite) -> None:
    _refused(write_suite("name: t\nx: &a [1, *a]\n", name="r.yaml"),
             "line 2: an alias refers to a value that contains it")
    _refused(write_suite("name: t\nx: " + "[" * 70 + "]" * 70 + "\n", name="d.yaml"),
             "nested more than 64 levels deep")
    # deeper than the YAML parser itself can recurse
    assert _refused(write_suite("name: t\nx: " + "[" * 200_000, name="e.yaml"),
                    "nested too deeply") < 3.0


def test_a_file_over_the_size_cap_is_refused_before_it_is_parsed(write_suite) -> None:
    path = write_suite("name: t\ndescription: " + "x" * (50 * MAX_SPEC_BYTES) + "\n")
    assert _refused(path, "larger than 1024 KiB, too large for a spec file") < 1.0


def test_list_suites_shows_a_hostile_file_as_invalid_and_lists_the_others(write_suite,
                                                                          monkeypatch) -> None:
    path = write_suite(LAUGHS, name="laughs.yaml")
    monkeypatch.setenv("CLBENCH_SUITE_PATH", str(path.parent))
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["list", "suites"], catch_exceptions=False)
    assert time.perf_counter() - started < 5.0
    assert result.exit_code == 0, result.output
    assert "laughs" in result.output and "invalid" in result.output
    assert "starter" in result.output


def test_a_symlink_loop_on_the_suite_path_is_passed_over(tmp_path, monkeypatch) -> None:
    """A loop among CLBENCH_SUITE_PATH's folders (or one that cannot be reached) is left out:
    every suite command still works with the others."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setenv("CLBENCH_SUITE_PATH", f"{tmp_path / 'a'}:/proc/1/root/nowhere")
    for args in (["list", "suites"], ["validate", "smoke"],
                 ["run", "--suite", "smoke", "--method", "sft", "--plan"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)


def test_field_errors_give_the_line_and_column_in_plain_words(write_suite) -> None:
    path = write_suite("name: Tiny!\n"
                       "stages:\n"
                       "  - name: a\n"
                       "    task: {source: math.arithmetic}\n"
                       "    budget: {steps: 0}\n")
    with pytest.raises(SpecError) as info:
        load_suite(path)
    message = str(info.value)
    assert (f"{path}: name (line 1, column 7): 'Tiny!' is not allowed here: expected "
            "lowercase letters, digits, '_', '.' and '-', starting with a letter or digit"
            in message)
    assert f"{path}: stages[0].budget.steps (line 5, column 21): Input should be greater" \
        in message
    for jargon in ("<root>", "Value error", "^[a-z0-9]", "String should match pattern"):
        assert jargon not in message


def test_a_field_set_by_an_override_is_not_placed_in_the_file(write_suite) -> None:
    path = write_suite("name: t\nstages:\n  - name: a\n    task: {source: math.arithmetic}\n"
                       "    budget: {steps: 3}\n")
    with pytest.raises(SpecError) as info:
        load_suite(path, ["stages[0].budget.steps=0"])
    assert "stages[0].budget.steps: Input should be greater" in str(info.value)
    assert "line 5" not in str(info.value)


def test_a_model_validator_error_reads_as_a_sentence(write_suite) -> None:
    path = write_suite("name: t\nschema_version: 99\nstages:\n  - name: a\n"
                       "    task: {source: math.arithmetic}\n")
    with pytest.raises(SpecError) as info:
        load_suite(path)
    assert "schema_version (line 2, column 17): " in str(info.value)
    assert "Value error" not in str(info.value)


def test_validate_refuses_float16_as_run_does(write_suite) -> None:
    from conftest import VALID_SUITE

    path = write_suite(VALID_SUITE + "model: {name: tiny-llama, dtype: float16}\n")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2
    assert "model.dtype (line" in result.output
    assert "float16 cannot be trained by clbench" in result.output
    plan = CliRunner().invoke(cli, ["run", "--suite", str(path), "--method", "sft", "--plan"])
    assert plan.exit_code == 2 and "float16 cannot be trained" in plan.output


# -- any input ---------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
KEYS = st.sampled_from(["name", "version", "stages", "probes", "protocol", "model", "task",
                        "budget", "steps", "source", "params", "eval_size", "metrics", "kind",
                        "lm_eval", "decoding", "diagnostics", "methods", "description", "x"])
DOCUMENTS = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=30)


def _mutated_starter(data: st.DataObject) -> str:
    """The starter suite with one value somewhere replaced by an arbitrary one."""
    suite = yaml.safe_load(resolve_suite("starter").read_text(encoding="utf-8"))
    node, path = suite, []
    while isinstance(node, (dict, list)) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        path.append(key)
        if data.draw(st.booleans()):
            break
        node = node[key]
    target = suite
    for key in path[:-1]:
        target = target[key]
    if path:
        target[path[-1]] = data.draw(DOCUMENTS)
    return yaml.safe_dump(suite)


def _largest_count(text: str) -> int:
    """The largest integer in a document that a size field would accept (0 if none)."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return 0
    nodes, largest = [document], 0
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
        elif isinstance(node, int) and not isinstance(node, bool) and node <= MAX_ITEMS:
            largest = max(largest, node)
    return largest


def _time_bound(text: str) -> float:
    """Seconds `validate` may take: bounded by the work the document asks for, not fast.

    Validation draws every column's items to check the sizes fit; a size past a task's item
    space is refused after 5,000 misses in a row (1-3 s, once 9.7 s on a loaded 2-core machine),
    and a size near the item space of the tool-use tasks draws ~1 ms an item per column
    (`protocol.eval_size: 39407` on the starter: 49 s).
    """
    return 30.0 + 3e-3 * _largest_count(text)


def _check_any(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert time.perf_counter() - started < _time_bound(text)
    assert result.exit_code in (0, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert f"FAIL {path}" in result.output.replace("\n", " ")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab: -[]{}&*!|>'\"#\n\t,?%@`\\0.9")),
                    max_size=200))
def test_any_text_validates_or_is_refused_with_a_message(text: str, tmp_path: Path) -> None:
    _check_any(tmp_path / "any.yaml", text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(document=DOCUMENTS)
def test_any_document_validates_or_is_refused_with_a_message(document, tmp_path: Path) -> None:
    _check_any(tmp_path / "doc.yaml", yaml.safe_dump(document))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_starter_with_any_value_replaced_validates_or_names_the_field(data, tmp_path: Path
                                                                          ) -> None:
    path = tmp_path / "mutated.yaml"
    _check_any(path, _mutated_starter(data))


@pytest.mark.parametrize("field, value, message", [
    ("stages[0].task.train_size", "1000000000000", "Input should be less than or equal to 100000"),
    ("protocol.eval_size", "100001", "Input should be less than or equal to 100000"),
    ("stages[0].budget.samples_per_prompt", "1e9", "Input should be"),
    ("stages[0].budget.temperature", ".inf", "Input should be a finite number"),
    ("protocol.diagnostics.collapse.score_floor", ".nan", "Input should be a finite number"),
])
def test_counts_are_bounded_and_numbers_finite_before_any_work(field: str, value: str,
                                                              message: str) -> None:
    """A suite asking for 10^12 items once made `validate` draw until memory ran out; an
    infinite setting validated, then crashed writing run.json."""
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--plan",
                                      "--set", f"{field}={value}"])
    assert result.exit_code == 2
    assert f"{field}: {message}" in " ".join(result.output.split())
    assert time.perf_counter() - started < 5.0
