"""The continual protocol end to end on a tiny model: CLI run, results, refusal, sweep, report.

The plugins (`fakes.EchoDigit`, `fakes.EchoSFT`) are small but real: see tests/fakes.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fakes import (
    PLUGINS,
    SUITE,
    run_cli,
    write_suite,
)

from clbench.plugins import registry
from clbench.results import read_results
from clbench.spec.options import RunSettings

# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


pytestmark = pytest.mark.e2e  # a suite run end to end


def test_cli_run_writes_a_complete_valid_result(tmp_path: Path) -> None:
    suite = write_suite(tmp_path)
    out = tmp_path / "run"
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--seed", "0",
                   "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.status == "complete"
    assert result.row_labels == ["base", "after low", "after high"]
    assert [c.name for c in result.columns] == ["low", "high", "all"]
    assert all(c is not None and c.n == 6 for row in result.matrix for c in row)
    R = result.score_matrix()
    # each stage learns its digit (the probe asks for the first); the second makes the model
    # forget the first
    assert R[0] == [0.0, 0.0, 0.0] and R[1][0] == R[1][2] == 1.0 and R[2][1] == 1.0, R
    assert R[2][0] < R[1][0] and R[1][1] < R[2][1], R
    # metrics are computed from the stored matrix with the protocol's variants
    assert result.metrics["acc"].value == pytest.approx((R[2][0] + R[2][1]) / 2)
    assert result.metrics["la"].value == pytest.approx((R[1][0] + R[2][1]) / 2)
    assert result.metrics["forgetting"].value == pytest.approx(R[1][0] - R[2][0])
    assert result.metrics["bwt"].value == pytest.approx(R[2][0] - R[1][0])
    assert result.metrics["bwt"].variant == "t_minus_1"
    assert result.metrics["forgetting"].higher_is_better is False
    assert result.metrics["ood_delta"].value == pytest.approx(R[2][2] - R[0][2])
    assert result.metrics["general_delta"].value is None  # the suite has no general probe
    # every cell is traceable to its items
    for row in range(3):
        for col, name in enumerate(["low", "high", "all"]):
            lines = (out / "items" / f"row{row}" / f"{name}.jsonl").read_text().splitlines()
            assert sum(json.loads(x)["correct"] for x in lines) / 6 == R[row][col]
    # and a few of the last row's completions travel in the results file: a right one and a
    # wrong one where the column has both, in item order
    last = [[json.loads(x) for x in (out / "items" / "row2" / f"{name}.jsonl").read_text()
             .splitlines()] for name in ("low", "high", "all")]
    for name, records in zip(["low", "high", "all"], last):
        expected = [r for r in records if r in ([x for x in records if x["correct"]][:1]
                                                + [x for x in records if not x["correct"]][:1]
                                                + records[:2])][:2]
        shown = result.examples[name]
        assert 1 <= len(shown) <= 2 and [x.id for x in shown] == [r["id"] for r in expected][
            :len(shown)]
        if {r["correct"] for r in records} == {True, False}:
            assert {x.correct for x in shown} == {True, False}
    assert [s.index for s in result.stages] == [1, 2]
    assert result.stages[1].summary["lr"] == pytest.approx(3e-2 / 2)  # method state carried
    assert result.compute.tokens == {"trained_tokens": 10 * (8 + 8)}
    assert (out / "run.log").read_text().count("stage 2 step") == 8
    # the last stage's checkpoint, and the base weights drift is measured against
    assert sorted((out / "checkpoints").iterdir()) == [
        out / "checkpoints" / "base-weights.safetensors", out / "checkpoints" / "stage2"]
    assert not (out / "work").exists()
    assert "bwt" in res.output and "after high" in res.output
    # no terminal here: progress comes as lines (every minute, and as each task completes)
    lines = res.output.splitlines()
    for done in ("row 0: eval low 6/6", "stage 1 low: train 8/8", "row 1: eval all 6/6",
                 "stage 2 high: train 8/8", "stages 2/2"):
        assert any(f" {done}, " in line and line.endswith(", done") for line in lines), done


def test_run_dir_of_another_spec_is_refused(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    out = tmp_path / "run"
    base = ["run", "--suite", str(suite), "--out", str(out), "--device", "cpu"]
    assert run_cli(base + ["--method", "test.echo-sft"]).exit_code == 0
    before = (out / "results.json").read_bytes()
    other_seed = run_cli(base + ["--method", "test.echo-sft", "--seed", "1", "--resume"])
    assert other_seed.exit_code == 2
    assert "holds another run (seed: 0 there, 1 now); choose another --out" in \
        other_seed.output.replace("\n", " ")
    other_cfg = run_cli(base + ["--method", "test.echo-sft", "--set", "method.lr=0.5",
                                "--resume"])
    assert other_cfg.exit_code == 2
    assert "(method.lr: 0.03 there, 0.5 now); to continue it, add --set method.lr=0.03;" in \
        other_cfg.output.replace("\n", " ")
    other_method = run_cli(base + ["--method", "sft", "--resume"])
    assert other_method.exit_code == 2  # the method alone: its config differs as a consequence
    assert "holds another run (method: test.echo-sft there, sft now); choose " \
        "another --out" in other_method.output.replace("\n", " ")
    again = run_cli(base + ["--method", "test.echo-sft"])
    assert again.exit_code == 2 and "pass --resume" in again.output.replace("\n", " ")
    assert "Traceback" not in again.output
    assert (out / "results.json").read_bytes() == before  # nothing was overwritten
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    res = run_cli(base[:3] + ["--out", str(stranger), "--device", "cpu", "--method",
                           "test.echo-sft"])
    assert res.exit_code == 2 and "holds no clbench run" in res.output.replace("\n", " ")


def test_a_run_reports_its_own_peak_memory_not_an_earlier_runs_in_the_process(
        tmp_path: Path) -> None:
    """An in-process sweep runs one run after another in one process: the process's peak is the
    largest run's so far, and each run must report its own instead."""
    import numpy as np
    import torch

    from clbench.results import reset_peak_memory, resident_peak_bytes

    earlier = np.ones(2**30 // 8)  # 1 GiB touched, as a larger run before this one would
    del earlier
    high_water = resident_peak_bytes()
    if not reset_peak_memory(torch.device("cpu")) or resident_peak_bytes() > high_water - 2**29:
        pytest.skip("this system cannot reset the peak of resident memory (Linux's clear_refs)")
    np.ones(2**30 // 8)  # the process's peak is high again when the run starts
    high_water = resident_peak_bytes()
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--out",
                   str(tmp_path / "run"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    peak = read_results(tmp_path / "run" / "results.json").compute.peak_memory_bytes
    assert peak is not None and 0 < peak < high_water - 2**29, (peak, high_water)


@pytest.mark.parametrize("stopped_in", ["metric_values", "print_summary"])  # by the run, the CLI
def test_ctrl_c_after_the_last_row_says_whether_the_run_completed(tmp_path: Path, monkeypatch,
                                                                  stopped_in: str) -> None:
    from clbench.report import runs
    from clbench.run import recipe

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 2"))
    out = tmp_path / "run"
    args = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--out", str(out),
            "--device", "cpu"]

    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(runs if stopped_in == "print_summary" else recipe, stopped_in, ctrl_c)
        res = run_cli(args)
    said = " ".join(res.output.split())
    assert res.exit_code == 130 and "Traceback" not in res.output
    stored = read_results(out / "results.json")
    assert len(stored.matrix) == 3  # every row of R was saved before the stop
    if stopped_in == "print_summary":  # results written: nothing is left to do
        assert f"interrupted; the run had completed: clbench report {out} prints it" in said
        assert stored.status == "complete" and stored.metrics["acc"].value is not None
        return
    assert "interrupted; every row of R is saved; the same command plus --resume completes " \
        "the results" in said
    assert stored.status == "partial" and not stored.metrics
    resumed = run_cli(args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    done = read_results(out / "results.json")
    assert done.status == "complete" and done.matrix == stored.matrix  # nothing trained again
    R = done.score_matrix()
    assert done.metrics["acc"].value == pytest.approx((R[2][0] + R[2][1]) / 2)
    assert (out / "run.log").read_text().count("stage 2 step") == 2


def test_sweep_skips_complete_runs_and_report_aggregates(tmp_path: Path) -> None:
    from clbench.report.runs import report
    from clbench.sweep.grid import sweep

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    root = tmp_path / "grid"
    with registry.extra_plugins(**PLUGINS):
        sweep(str(suite), ["test.echo-sft"], [0, 1], root, RunSettings(device="cpu"))
        first = {s: (root / "test.echo-sft" / f"s{s}" / "results.json").stat().st_mtime_ns
                 for s in (0, 1)}
        from rich.console import Console
        console = Console(record=True, width=200)
        data = sweep(str(suite), ["test.echo-sft"], [0, 1], root, RunSettings(device="cpu"),
                     console=console)
    text = console.export_text()
    assert text.count("complete") >= 2 and "skip test.echo-sft seed 0" in text
    assert {s: (root / "test.echo-sft" / f"s{s}" / "results.json").stat().st_mtime_ns
            for s in (0, 1)} == first  # nothing re-run
    (summary,) = data.values()
    acc = summary["test.echo-sft"]["acc"]
    assert acc["n"] == 2
    runs = [read_results(root / "test.echo-sft" / f"s{s}" / "results.json") for s in (0, 1)]
    assert acc["mean"] == pytest.approx(sum(r.metrics["acc"].value for r in runs) / 2)
    as_json = report([root], as_json=True, console=Console(file=open(tmp_path / "j", "w")))
    assert len(as_json["runs"]) == 2 and as_json["comparison"] == data


def test_report_command_on_a_finished_run(tmp_path: Path) -> None:
    suite = write_suite(tmp_path)
    out = tmp_path / "run"
    assert run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--out", str(out),
                    "--device", "cpu"]).exit_code == 0
    from rich.console import Console

    from clbench.report.runs import report

    console = Console(record=True, width=200)
    data = report([out], console=console)
    text = console.export_text()
    assert "after high" in text and "(n=1)" in text
    assert data["runs"][0]["matrix"] == read_results(out / "results.json").score_matrix()
    from clbench.errors import UserError
    with pytest.raises(UserError, match="nowhere: no such run directory"):
        report([tmp_path / "nowhere"])
    assert report([out / "results.json"], console=console)["runs"] == data["runs"]
    copied = tmp_path / "echo-s0.json"  # a results file kept outside its run folder
    copied.write_bytes((out / "results.json").read_bytes())
    (again,) = report([copied], console=console)["runs"]
    assert again["matrix"] == data["runs"][0]["matrix"] and again["dir"] == str(copied)


def test_report_shows_every_metric_and_leaves_out_unreadable_results(tmp_path: Path) -> None:
    """`op` (and any metric the protocol asks for) is shown; a damaged results.json found by
    searching a folder is left out with a note, and is an error when named itself."""
    from rich.console import Console

    from clbench.errors import UserError
    from clbench.report.runs import report

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1").replace(
        "  eval_size: 6\n", "  eval_size: 6\n  metrics: [acc, op, bwt, intransigence]\n"))
    root = tmp_path / "grid"
    assert run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft",
                    "--out", str(root / "ok"), "--device", "cpu"]).exit_code == 0
    (root / "broken").mkdir()
    (root / "broken" / "results.json").write_text("{not json")
    console = Console(record=True, width=200)
    data = report([root], console=console)
    text = console.export_text()
    assert "op ↑" in text and "acc ↑" in text and "bwt ↑" in text
    # an undefined metric says why
    assert "intransigence ↓ │ — (needs a joint (multi-task) reference run)" in text
    assert [r["dir"] for r in data["runs"]] == [str(root / "ok")]
    assert "left out: " in text and "broken/results.json: not a readable JSON results file" in text
    assert data["skipped"] and "broken" in data["skipped"][0]
    with pytest.raises(UserError, match="not a readable JSON results file"):
        report([root / "broken"])


def test_report_shows_every_run_before_refusing_a_comparison_of_two_runs_of_a_seed(
        tmp_path: Path) -> None:
    """Two different results of one method and seed under one folder: which one the comparison
    should count is the user's call, but each run's own tables are still printed first."""
    from rich.console import Console

    from clbench.errors import UserError
    from clbench.report.runs import report

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    root = tmp_path / "grid"
    assert run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft",
                    "--out", str(root / "a"), "--device", "cpu"]).exit_code == 0
    other = json.loads((root / "a" / "results.json").read_text())
    other["matrix"][1][0]["score"] = 0.5  # another run's numbers, same method and seed
    (root / "b").mkdir()
    (root / "b" / "results.json").write_text(json.dumps(other))
    console = Console(record=True, width=200)
    with pytest.raises(UserError, match=r"two different runs of test.echo-sft seed 0: .*a and "
                                        r".*b; name one of them"):
        report([root], console=console)
    assert console.export_text().count("R: echo / test.echo-sft / seed 0 (complete)") == 2


def test_report_and_sweep_commands_through_the_cli(tmp_path: Path) -> None:
    suite = write_suite(tmp_path)
    root = tmp_path / "grid"
    res = run_cli(["sweep", "--suite", str(suite), "--methods", "test.echo-sft", "--seeds", "0",
                   "--out", str(root), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "(n=1)" in res.output  # a single seed says so
    res = run_cli(["report", str(root), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["runs"][0]["status"] == "complete" and data["runs"][0]["seed"] == 0
    assert data["comparison"]
    ((cost,),) = data["cost"].values()  # one method on one kind of hardware
    assert (cost["method"], cost["hardware"], cost["runs"]) == ("test.echo-sft", "cpu", 1)
    md = run_cli(["report", str(root), "--markdown"])
    assert md.exit_code == 0, md.output
    result = read_results(root / "test.echo-sft" / "s0" / "results.json")
    lines = md.output.splitlines()
    header = lines.index("| after | " + " | ".join(f"{c.name} ({c.kind})"
                                                   for c in result.columns) + " |")
    assert lines[header + 1] == "|---|" + "|".join(["---:"] * len(result.columns)) + "|"
    R = result.score_matrix()
    # rows differ, and so do the stream columns: a table with rows or columns swapped shows
    assert len({tuple(row) for row in R}) == 3 and [r[0] for r in R] != [r[1] for r in R]
    for label, row, line in zip(result.row_labels, R, lines[header + 2:]):
        assert line == f"| {label} | " + " | ".join(f"{v:.3f}" for v in row) + " |"
    acc = result.metrics["acc"].value
    assert f"| acc ↑ | {acc:.3f} | {result.metrics['acc'].variant} |" in lines
    assert any(line.startswith(f"| test.echo-sft | {acc:.3f} (n=1) |") for line in lines)
    assert any(line.startswith("| test.echo-sft | cpu | 1 | 0:00:") for line in lines)  # cost
    from clbench.report.runs import markdown_report

    odd = result.model_copy(deep=True)  # names a table must not break on
    odd.columns[0].name, odd.row_labels[0] = "a|b\nc", "base\nline"
    text = markdown_report([(root, odd)], {})
    assert "| base line | " in text and "| after | a\\|b c (" in text
    odd.matrix, odd.row_labels = [], []
    assert "No row of R yet." in markdown_report([(root, odd)], {})
    both = run_cli(["report", str(root), "--markdown", "--json"])
    assert both.exit_code == 2 and "--json and --markdown: choose one" in both.output
    missing = run_cli(["report", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "nothing: no such run directory" in missing.output
    (tmp_path / "empty").mkdir()
    empty = run_cli(["report", str(tmp_path / "empty")])
    assert empty.exit_code == 2 and "no results.json in it or below" in empty.output


METHOD_LOGS = {"sft": "loss", "grpo": "groups_with_signal", "sdpo": "teacher_kl",
               "sdpo-cot": "teacher_kl", "stable-sdpo": "teacher_kl"}


@pytest.mark.parametrize("method", sorted(METHOD_LOGS))
def test_smoke_suite_with_each_builtin_method_through_the_cli(tmp_path: Path, method: str) -> None:
    from clbench.cli import cli

    out = tmp_path / "smoke"
    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", method, "--out",
                                   str(out), "--device", "cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    result = read_results(out / "results.json")
    assert result.status == "complete" and len(result.matrix) == 3
    assert set(result.metrics) >= {"acc", "la", "bwt", "fwt", "forgetting", "ood_delta"}
    from clbench.train.cpu import process_allocator

    assert result.model.resolved["allocator"] == process_allocator()  # recorded with the run
    # under glibc a CPU run says how to preload jemalloc, under jemalloc it does not
    assert ("uses glibc's malloc" in res.output) == (process_allocator() == "glibc")
    assert [s.index for s in result.stages] == [1, 2]
    for stage in result.stages:
        assert METHOD_LOGS[method] in stage.summary, sorted(stage.summary)
        assert stage.counters.get("trained_tokens", 0) > 0


def test_diagnostics_in_the_old_list_form_are_refused_with_the_new_form(tmp_path: Path) -> None:
    from clbench.cli import cli

    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--out",
                                   str(tmp_path / "r"), "--set",
                                   "protocol.diagnostics=[weight_drift]"])
    assert res.exit_code == 2
    assert "diagnostics is a mapping" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "r" / "results.json").exists()
    # found as early by the commands that only read the suite
    plan = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--plan",
                                    "--set", "protocol.diagnostics=[weight_drift]"])
    assert plan.exit_code == 2 and "protocol.diagnostics" in plan.output
    suite = tmp_path / "with-diagnostics.yaml"
    from clbench.spec.suites import resolve_suite
    suite.write_text(resolve_suite("smoke").read_text().replace(
        "protocol:\n", "protocol:\n  diagnostics: [artifacts]\n"))
    assert "diagnostics: [artifacts]" in suite.read_text()
    checked = CliRunner().invoke(cli, ["validate", str(suite)])
    assert checked.exit_code == 2 and "diagnostics is a mapping" in checked.output
    suite.write_text(resolve_suite("smoke").read_text().replace(
        "protocol:\n", "protocol:\n  diagnostics: {weight_drift: {k: 4}}\n"))
    assert CliRunner().invoke(cli, ["validate", str(suite)]).exit_code == 0




def test_a_run_on_the_static_cache_engine_scores_row_0_as_the_decode_loop(tmp_path: Path
                                                                         ) -> None:
    import transformers

    from clbench.cli import cli
    from clbench.eval.records import read_records, records_path
    from clbench.train.rollout import STATIC_CACHE_MIXED_PRECISION

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if version < STATIC_CACHE_MIXED_PRECISION:  # the lowest-versions run: refused, said why
        res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "grpo", "--out",
                                       str(tmp_path / "old"), "--device", "cpu", "--set",
                                       "model.generation=static", "--set",
                                       "model.dtype=bfloat16"])
        assert res.exit_code == 2 and "static under mixed precision needs transformers" in \
            " ".join(res.output.split())
        return
    rows = {}
    for engine in ("loop", "static"):
        out = tmp_path / engine
        res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "grpo", "--out",
                                       str(out), "--device", "cpu", "--no-base-cache", "--set",
                                       f"model.generation={engine}"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        result = read_results(out / "results.json")
        assert result.status == "complete" and result.model.spec["generation"] == engine
        # the rollouts came from the engine too: transformers' generate measures no entropy
        assert ("rollout_entropy" in result.stages[0].summary) == (engine == "loop")
        rows[engine] = {column.name: [(r.completion, r.correct)
                                 for r in read_records(records_path(out, 0, column.name))]
                        for column in result.columns}
    assert rows["static"] == rows["loop"]  # greedy: the same tokens on the same weights


def test_a_run_draws_each_of_its_items_once(tmp_path: Path) -> None:
    """Validating the suite, planning the columns and drawing the training sets all ask for
    items: each (source, parameters, split, seed, size) is drawn once in a run (and a resumed
    or second run in the process draws none again)."""
    from fakes import EchoDigit, EchoSFT

    from clbench.plugins import registry

    builds: list[tuple[str, str, int, int]] = []

    class Counted(EchoDigit):
        def build(self, split, seed, size):
            builds.append((self.params.digit, split, seed, size))  # type: ignore[attr-defined]
            return super().build(split, seed, size)

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    args = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu"]
    with registry.extra_plugins(methods={"test.echo-sft": EchoSFT},
                                tasks={"test.echo-digit": Counted}):
        from click.testing import CliRunner

        from clbench.cli import cli

        res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "a")])
        assert res.exit_code == 0, res.output
        assert builds and len(builds) == len(set(builds)), builds
        # both stages' training items and every column's evaluation items
        assert sorted(builds) == [("3", "eval", 1, 6), ("3", "eval", 3, 6), ("3", "train", 1, 20),
                                  ("7", "eval", 2, 6), ("7", "train", 2, 20)]
        drawn = len(builds)
        res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "b"), "--seed", "1"])
        assert res.exit_code == 0, res.output
        assert len(builds) == drawn  # the same items: none drawn again
