"""Comparing runs: grouping by suite and method setting, metrics over seeds, cost per run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fakes import old_suite_hash, result_of, run_spec, smoke_run
from test_pairwise import _run as complete_run

from clbench.plugins import registry
from clbench.report.comparison import comparison as compare_groups
from clbench.report.comparison import comparison_groups, cost_comparison, cost_tables
from clbench.results import MetricValue


def test_runs_from_before_a_schema_addition_are_compared_with_later_ones(tmp_path: Path) -> None:
    run = smoke_run(tmp_path)
    results = []
    for seed, acc in [(0, 0.5), (1, 0.7)]:
        result = result_of(run.model_copy(update={"seed": seed}))
        result.status, result.metrics = "complete", {"acc": MetricValue(value=acc)}
        results.append(result)
    older = results[0]
    del older.suite["model"]["mixed_precision"]
    older.suite_hash = old_suite_hash(older.suite)
    table = comparison([(tmp_path / f"s{r.seed}", r) for r in results])
    assert len(table) == 1  # one suite, not two
    (methods,) = table.values()
    summary = methods["sft"]["acc"]
    assert summary["n"] == 2 and summary["mean"] == pytest.approx(0.6)


def test_runs_of_one_method_under_other_settings_are_compared_apart(tmp_path: Path) -> None:
    """Seeds of `sdpo` at two settings are two rows, each named by what tells it apart; a run
    from before `feedback_with_demo` existed groups with runs that set it as it behaved; the
    same run found twice counts once, and two different runs of one seed are refused."""
    from clbench.errors import UserError
    run = run_spec("smoke", "sdpo", seed=0, out_dir=tmp_path / "run")
    default = registry.validate_method_params("sdpo", None).model_dump(mode="json")
    older = {k: v for k, v in default.items() if k != "feedback_with_demo"}  # before the field

    def result(seed: int, config: dict, acc: float):
        r = result_of(run.model_copy(update={"seed": seed}), config)
        r.status, r.metrics = "complete", {"acc": MetricValue(value=acc)}
        return r

    a0 = result(0, default, 0.5)
    found = [(tmp_path / "a0", a0), (tmp_path / "a1", result(1, default, 0.7)),
             (tmp_path / "b0", result(0, older, 0.1)),
             (tmp_path / "b1", result(1, {**default, "feedback_with_demo": True}, 0.3)),
             (tmp_path / "copy-of-a0.json", a0.model_copy(deep=True))]
    (methods,) = comparison(found).values()
    assert sorted(methods) == ["sdpo (feedback_with_demo=false)", "sdpo (feedback_with_demo=true)"]
    assert methods["sdpo (feedback_with_demo=false)"]["acc"]["mean"] == pytest.approx(0.6)
    assert methods["sdpo (feedback_with_demo=true)"]["acc"]["mean"] == pytest.approx(0.2)
    assert methods["sdpo (feedback_with_demo=false)"]["acc"]["n"] == 2  # the copy counts once
    with pytest.raises(UserError, match=r"two different runs of sdpo \(feedback_with_demo=false"
                                        r"\) seed 0: .*a0 and .*other"):
        comparison(found + [(tmp_path / "other", result(0, default, 0.9))])
    (alone,) = comparison(found[:2]).values()
    assert list(alone) == ["sdpo"]  # one setting: the plain name


def _complete(seed: int, seconds: float | None, device: str = "cpu", peak: int | None = None,
              processes: int = 1):
    run = run_spec("smoke", "sft", seed=seed, out_dir="unused")
    r = result_of(run, registry.validate_method_params("sft", None).model_dump(mode="json"))
    r.status, r.metrics = "complete", {"acc": MetricValue(value=0.5)}
    if seconds is not None:
        r.compute.wall_time_s, r.compute.device, r.compute.peak_memory_bytes = \
            seconds, device, peak
    r.model.resolved["num_processes"] = processes
    return r


def test_cost_per_run_by_hardware_with_wall_time_and_peak_memory(tmp_path: Path) -> None:
    found = [(tmp_path / "a", _complete(0, 4000.0, peak=4000 * 2**20)),
             (tmp_path / "b", _complete(1, 11200.0, peak=11200 * 2**20)),
             (tmp_path / "c", _complete(2, 243.6, "cuda:0", peak=6 * 2**30)),
             (tmp_path / "d", _complete(3, 90.0, "cuda:0", processes=4))]
    (rows,) = cost_comparison(comparison_groups(found)).values()
    assert [(c["hardware"], c["runs"]) for c in rows] == [("cpu", 2), ("cuda", 1), ("cuda x4", 1)]
    assert rows[0]["wall_time_s"]["mean"] == pytest.approx(7600.0)
    assert rows[0]["peak_memory_bytes"] == 11200 * 2**20  # the largest, not a mean
    ((title, header, table),) = cost_tables(cost_comparison(comparison_groups(found)))
    assert title == "smoke: cost per run"
    assert header == ["method", "hardware", "runs", "wall time per run", "peak memory"]
    assert table == [
        ["sft", "cpu", "2", "2:06:40 ± 1:24:51 (n=2)", "10.9 GiB (resident memory)"],
        # one seed: no spread
        ["sft", "cuda", "1", "0:04:04 (n=1)", "6.0 GiB (GPU memory allocated)"],
        ["sft", "cuda x4", "1", "0:01:30 (n=1)", "—"]]


def test_cost_of_runs_that_recorded_none(tmp_path: Path) -> None:
    """Results from before compute was recorded (or a run resumed from row 0 only) show a dash,
    not a zero."""
    groups = comparison_groups([(tmp_path / "a", _complete(0, None))])
    ((_, _, table),) = cost_tables(cost_comparison(groups))
    assert table == [["sft", "unrecorded", "1", "—", "—"]]


def comparison(found):
    """Metrics over seeds of runs as found on disk (path, result)."""
    return compare_groups(comparison_groups(found))


def test_a_table_into_a_file_is_printed_whole_and_on_a_terminal_fits_the_window() -> None:
    """Into a log or `> report.txt` rich assumes 80 columns and would cut headers and cells to
    `…`; there the table keeps its natural width. A terminal still gets it fitted to its width."""
    import io

    from rich.console import Console
    from rich.table import Table

    from clbench.report.tables import print_uncut

    names = [f"column_with_a_long_name_{i}" for i in range(9)]
    table = Table(title="R")
    for name in names:
        table.add_column(name, justify="right")
    table.add_row(*[f"0.{i}50 (n=100)" for i in range(9)])

    into_file = Console(file=io.StringIO(), width=80)
    assert not into_file.is_terminal
    print_uncut(into_file, table)
    text = into_file.file.getvalue()
    assert "…" not in text and all(name in text for name in names)
    assert all(f"0.{i}50 (n=100)" in text for i in range(9))
    assert into_file.width == 80  # the console's own width is left as it was

    terminal = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    print_uncut(terminal, table)
    assert max(map(len, terminal.file.getvalue().splitlines())) <= 80


def test_an_entry_mixing_code_versions_says_which_seeds_ran_which(tmp_path: Path) -> None:
    """Seeds of one method made by different commits (of clbench, or of the method's own
    checkout) are still one entry, but the report names each version and its seeds, in the
    tables, the JSON and the Markdown; seeds of one version give no such line."""
    from rich.console import Console

    from clbench.report.runs import report
    from clbench.results import write_results

    revisions = {0: ("a" * 40, None), 1: ("b" * 40 + "+dirty", None),
                 2: ("a" * 40, "c" * 40)}  # seed 2: clbench at a, its method from another
    for seed, (own, method) in revisions.items():
        r = complete_run(tmp_path, "sft", seed, 0.5)
        r.git_revision, r.method.git_revision = own, method
        write_results(tmp_path / "mixed" / f"s{seed}" / "results.json", r)
    expected = ("smoke / sft: runs of different code (clbench aaaaaaa: seed 0; "
                "clbench aaaaaaa, method ccccccc: seed 2; clbench bbbbbbb+dirty: seed 1)")
    console = Console(record=True, width=400)
    data = report([tmp_path / "mixed"], console=console)
    assert data["mixed_code"] == [expected]
    assert expected in console.export_text()
    markdown = io.StringIO()
    report([tmp_path / "mixed"], console=Console(file=markdown), as_markdown=True)
    assert f"> {expected}" in markdown.getvalue()

    for seed in (0, 1):  # one commit, the method from the same checkout: nothing to say
        r = complete_run(tmp_path, "sft", seed, 0.5)
        r.git_revision = r.method.git_revision = "a" * 40
        write_results(tmp_path / "same" / f"s{seed}" / "results.json", r)
    assert "mixed_code" not in report([tmp_path / "same"], console=Console(record=True))
