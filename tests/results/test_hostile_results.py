"""Results files as untrusted input: their text is shown as text (no rich markup, no Markdown or
HTML), they are checked before they are shown (scores are fractions, a complete run has every
row, stored metrics match the matrix), nesting is bounded, an undefined cell round-trips, and one
bad file never hides the others."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fakes import result_of, run_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clbench.cli import cli
from clbench.results import Cell, read_results, write_results
from clbench.run.scores import metric_values

MARKUP = "grpo[/bold][link=https://evil.example]click[/link]"
INJECTION = "<script>alert(1)</script>\n# injected | cell"


def _result(tmp_path: Path, method: str = "sft", seed: int = 0):
    """A complete smoke-suite result with metrics computed from its matrix, as a run has."""
    run = run_spec("smoke", "sft", seed=seed, out_dir=tmp_path / "unused")
    result = result_of(run, {"lr": 1e-5})
    result.method.name = method
    result.matrix = [[Cell(score=0.1, n=10) for _ in result.columns],
                     [Cell(score=0.6, n=10) for _ in result.columns],
                     [Cell(score=0.5, n=10) for _ in result.columns]]
    result.row_labels = ["base", "after math", "after science"]
    result.metrics = metric_values(result, run.suite.protocol)
    result.status = "complete"
    return result


def _file(tmp_path: Path, name: str, result) -> Path:
    return write_results(tmp_path / "results" / f"{name}.json", result)


def _edited(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def report(*args: object):
    return CliRunner().invoke(cli, ["report", *map(str, args)])


def test_rich_markup_in_a_results_file_is_shown_as_written(tmp_path: Path) -> None:
    path = _file(tmp_path, "a", _result(tmp_path, MARKUP))
    result = report(path)
    assert result.exit_code == 0, result.output
    flat = result.output.replace("\n", "")
    assert "[/bold][link=https://evil.example]click[/link]" in flat  # text, not a link
    assert "Traceback" not in result.output


def test_markdown_report_escapes_html_and_markdown(tmp_path: Path) -> None:
    path = _file(tmp_path, "a", _result(tmp_path, INJECTION))
    out = report("--markdown", path).output
    assert "<script>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert not any(line.startswith("# injected") for line in out.splitlines())
    assert "\\# injected \\| cell" in out
    # every table row keeps its column count: the injected `|` is no cell border
    table = [line for line in out.splitlines() if line.startswith("| ")]
    header = next(line for line in table if line.startswith("| method"))
    row = next(line for line in table if "injected" in line)
    assert row.replace("\\|", "").count("|") == header.count("|")


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda d: d["matrix"][1][0].update(score=7.5), "matrix[1][0]: score 7.5 is not a fraction"),
    (lambda d: d["matrix"][1][0].update(ci_high=-0.5, ci_low=-1.0),
     "matrix[1][0]: ci_low -1.0 is not a fraction"),
    (lambda d: (d["matrix"].pop(), d["row_labels"].pop()),
     "a complete run has 3 rows of R (the base row and one per stage), this one 2"),
    (lambda d: d.update(extra=json.loads("[" * 40 + "]" * 40)), "nested more than 32 levels"),
])
def test_a_bad_file_is_left_out_with_why_and_the_others_are_shown(tmp_path: Path, edit,
                                                                    reason: str) -> None:
    good = _file(tmp_path, "good", _result(tmp_path, "sft"))
    bad = _edited(_file(tmp_path, "bad", _result(tmp_path, "grpo")), edit)
    result = report(bad, good)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert f"left out: {bad}: " in flat and reason in flat
    assert "smoke / sft / seed 0" in flat and "smoke / grpo" not in flat
    alone = report(bad)
    assert alone.exit_code == 2 and reason in " ".join(alone.output.split())


def test_nan_in_a_file_is_refused_and_nesting_beyond_the_parser_is_an_error(tmp_path: Path
                                                                            ) -> None:
    path = _file(tmp_path, "nan", _result(tmp_path))
    path.write_text(path.read_text().replace('"score": 0.6', '"score": NaN', 1))
    with pytest.raises(Exception, match=r"NaN is not a number a results file holds"):
        read_results(path)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(Exception, match="nested too deeply to be a results file"):
        read_results(deep)


def test_an_undefined_cell_round_trips_and_is_shown_as_a_dash(tmp_path: Path) -> None:
    from clbench.eval.column import CellResult
    from clbench.run.rows import to_cells

    (cell,) = to_cells([CellResult("general", float("nan"), 0.0, 80, None, [])])
    assert cell is not None and cell.score is None and cell.n == 80
    result = _result(tmp_path)
    result.matrix[2][-1] = cell
    path = _file(tmp_path, "undefined", result)
    assert read_results(path).matrix[2][-1] == cell  # written as null, read back
    shown = report("--markdown", path)
    assert shown.exit_code == 0, shown.output
    last = next(line for line in shown.output.splitlines() if line.startswith("| after science"))
    assert last.rstrip(" |").endswith("—")


def test_an_entry_without_an_acc_is_shown_unranked_beside_a_ranked_one(tmp_path: Path) -> None:
    """A final row with an undefined training cell leaves ACC undefined: the board still builds,
    that entry unranked, the other ranked as before (once, no entry at all had a rank)."""
    _file(tmp_path, "ranked", _result(tmp_path, method="sft"))
    unranked = _result(tmp_path, method="grpo")
    unranked.matrix[2][0] = Cell(score=None, n=10)
    unranked.metrics = metric_values(unranked, run_spec("smoke", "grpo").suite.protocol)
    _file(tmp_path, "unranked", unranked)
    for k, files in enumerate(([tmp_path / "results" / "unranked.json"],
                               [tmp_path / "results"])):
        site = tmp_path / f"site{k}"
        built = CliRunner().invoke(cli, ["leaderboard", "build", *map(str, files), "--out",
                                         str(site)])
        assert built.exit_code == 0, (built.output, built.exception)
        board = json.loads((site / "leaderboard.json").read_text())
        ranks = {e["method"]: e["rank"] for s in board["suites"] for e in s["entries"]}
        assert ranks["grpo"] is None
        assert ranks.get("sft", 1) == 1


def test_stored_metrics_are_recomputed_from_the_matrix_and_a_mismatch_is_said(tmp_path: Path
                                                                            ) -> None:
    path = _edited(_file(tmp_path, "forged", _result(tmp_path)),
                   lambda d: d["metrics"]["acc"].update(value=0.99))
    result = report(path)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert (f"recomputed: {path}: metric acc is stored as 0.99 but the matrix gives 0.5; the "
            "recomputed value is shown") in flat
    data = json.loads(report("--json", path).output)
    assert data["runs"][0]["metrics"]["acc"] == pytest.approx(0.5)
    assert data["recomputed"] == [f"{path}: metric acc is stored as 0.99 but the matrix gives 0.5"]
    built = CliRunner().invoke(cli, ["leaderboard", "build", str(path), "--out",
                                     str(tmp_path / "site"), "--strict"])
    assert built.exit_code != 0 and "metric acc is stored as 0.99" in built.output


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace('"seed": 0', '"seed": 0, "seed": 1'),
     "the key 'seed' is given twice in one object"),
    (lambda text: text.replace('"wall_time_s": 0.0', '"wall_time_s": Infinity'),
     "Infinity is not a number a results file holds"),
    (lambda text: text.replace('"score": 0.5', '"score": NaN', 1),
     "NaN is not a number a results file holds"),
])
def test_duplicate_keys_and_non_finite_numbers_are_refused_with_the_file_named(
        tmp_path: Path, edit, message: str) -> None:
    from clbench.results import ResultsError

    path = _file(tmp_path, "a", _result(tmp_path))
    changed = edit(path.read_text())
    assert changed != path.read_text()
    path.write_text(changed)
    with pytest.raises(ResultsError, match=f"^{path}: not a readable JSON results file: "
                                           f"{message}"):
        read_results(path)
    # the board leaves it out with its reason, and `report` says why
    res = CliRunner().invoke(cli, ["report", str(path)])
    assert res.exit_code == 2 and message in " ".join(res.output.split())


def test_terminal_escapes_in_a_results_file_reach_no_terminal(tmp_path: Path) -> None:
    escapes = "\x1b]0;owned\x07\x1b[2J\x1b[1A\x9b31m"
    result = _result(tmp_path, method=f"sft{escapes}")
    result.suite["description"] = f"about{escapes}"
    path = _file(tmp_path, "a", result)
    read = read_results(path)
    assert read.method.name == "sft]0;owned[2J[1A31m"  # the text, without its controls
    assert read.suite["description"].startswith("about]0;owned")
    for args in (["report", str(path)], ["report", str(path), "--json"],
                 ["report", str(path), "--markdown"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        assert not any(c in res.output for c in "\x1b\x07\x9b"), args


def test_a_fifo_or_an_oversized_file_is_refused_without_reading_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import clbench.results as results
    from clbench.results import ResultsError

    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)  # opening it to read would block until a writer came
    with pytest.raises(ResultsError, match="not a regular file"):
        read_results(fifo)
    path = _file(tmp_path, "a", _result(tmp_path))
    monkeypatch.setattr(results, "MAX_RESULTS_BYTES", 1000)
    with pytest.raises(ResultsError, match="larger than 0 MiB, too large"):
        read_results(path)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10**20, max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _mutated(data: Any, draw: Any) -> str:
    """A valid results document with one node, anywhere, replaced by any JSON value."""
    document = copy.deepcopy(data)
    node, path = document, []
    while isinstance(node, (dict, list)) and node:
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        if draw(st.booleans()):
            break
        node = node[key]
    target = document
    for key in path[:-1]:
        target = target[key]
    if path:
        target[path[-1]] = draw(JSON_VALUES)
    return json.dumps(document)


@pytest.fixture(scope="module")
def valid_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("valid")
    return json.loads(_file(folder, "valid", _result(folder)).read_text())


@settings(max_examples=120, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_results_file_with_any_value_replaced_is_read_or_refused_never_a_traceback(
        data: Any, valid_results: dict[str, Any], tmp_path: Path) -> None:
    """What a pull request may bring: the reader, `report` and the board end cleanly (exit 0
    or 2, one message) in bounded time, whatever one node of a results file holds."""
    import time

    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(_mutated(valid_results, data.draw))
    for args in (["report", str(folder)], ["report", str(folder), "--json"],
                 ["leaderboard", "build", str(folder), "--out", str(tmp_path / "site")]):
        started = time.perf_counter()
        result = CliRunner().invoke(cli, args)
        assert time.perf_counter() - started < 10.0
        assert result.exit_code in (0, 2), (args, result.output, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            (args, repr(result.exception))


@pytest.mark.parametrize("adapter", [1, "lora", [1, 2], None, {"kind": "none"}])
def test_a_recorded_adapter_of_any_shape_is_reported_not_a_traceback(
        adapter: Any, valid_results: dict[str, Any], tmp_path: Path) -> None:
    """Found by the property test above: `model.spec.adapter` replaced by a number."""
    results = json.loads(json.dumps(valid_results))
    results["model"]["spec"]["adapter"] = adapter
    (tmp_path / "results.json").write_text(json.dumps(results))
    result = CliRunner().invoke(cli, ["report", str(tmp_path), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
