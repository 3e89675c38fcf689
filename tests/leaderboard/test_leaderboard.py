"""The leaderboard: entries aggregated over seeds and kept apart by suite version, hostile names
escaped, malformed files skipped with their reason (or refused with --strict), a rebuild byte for
byte the same, and the `clbench leaderboard` commands."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import result_of, run_spec

from clbench.cli import cli
from clbench.errors import UserError
from clbench.leaderboard.site import build
from clbench.results import Cell, read_results, write_results
from clbench.run.scores import metric_values

HOSTILE = "<script>alert(1)</script>"


def _result(tmp_path: Path, method: str, seed: int, acc: float, *, version: str | None = None,
            name: str | None = None, status: str = "complete", items: int = 10):
    """A complete smoke-suite result whose matrix's last row is `acc` in every column, after a
    first stage that scored its column 10% higher: ACC `acc`, BWT -acc/10, forgetting acc/10."""
    run = run_spec("smoke", method, seed=seed, out_dir=tmp_path / "unused")
    if version is not None:
        run = run.model_copy(update={"suite": run.suite.model_copy(update={"version": version})})
    result = result_of(run, {"lr": 1e-5})
    if name is not None:
        result.method.name = name
    columns = len(result.columns)
    result.matrix = [[Cell(score=0.1, n=items) for _ in range(columns)],
                     [Cell(score=1.1 * acc if j == 0 else acc, n=items) for j in range(columns)],
                     [Cell(score=acc, n=items) for _ in range(columns)]]
    result.row_labels = ["base", "after math", "after science"]
    result.metrics = metric_values(result, run.suite.protocol)  # as a run computes them
    result.status = status  # type: ignore[assignment]
    result.compute.wall_time_s = 60.0 * (seed + 1)
    result.compute.tokens = {"generated": 1000}
    return result


def _write(folder: Path, name: str, result) -> Path:
    path = folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_results(path, result)
    return path


def test_entries_are_aggregated_over_seeds_and_suite_versions_never_share_a_table(
        tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    _write(results, "sft-s1", _result(tmp_path, "sft", 1, 0.7))
    _write(results, "grpo-s0", _result(tmp_path, "grpo", 0, 0.8))
    _write(results, "grpo-partial", _result(tmp_path, "grpo", 1, 0.0, status="partial"))
    _write(results / "v9", "sft-s0", _result(tmp_path, "sft", 0, 0.9, version="9"))
    data, problems = build([results], tmp_path / "site")
    assert problems == []
    by_version = {s["version"]: s for s in data["suites"]}
    assert len(data["suites"]) == 2 and "9" in by_version  # two tables, never one
    (current,) = [s for v, s in by_version.items() if v != "9"]
    assert [e["label"] for e in current["entries"]] == ["grpo", "sft"]  # ordered by ACC
    # one seed of 10 items against two: not separated, so they share the rank
    assert [(e["rank"], e["tied"]) for e in current["entries"]] == [(1, True), (1, True)]
    assert [x["why"] for x in data["left_out"]] == [
        "partial: 3 of 3 rows of the accuracy matrix; an entry averages complete runs only"]
    grpo, sft = current["entries"]
    assert grpo["n"] == 1 and grpo["metrics"]["acc"]["std"] is None  # the partial run is out
    acc = sft["metrics"]["acc"]
    std = math.sqrt(((0.5 - 0.6) ** 2 + (0.7 - 0.6) ** 2) / 1)
    assert acc["mean"] == pytest.approx(0.6) and acc["std"] == pytest.approx(std)
    half = 12.706 * std / math.sqrt(2)  # Student's t with one degree of freedom
    assert (acc["low"], acc["high"]) == pytest.approx((0.6 - half, 0.6 + half))
    assert sft["metrics"]["forgetting"]["higher_is_better"] is False
    assert sft["matrix"]["mean"][2][0] == pytest.approx(0.6)
    assert sft["compute"]["wall_time_s"] == pytest.approx(90.0)
    assert current["metric_variants"] == {"acc": "standard", "la": "standard",
                                          "bwt": "t_minus_1", "fwt": "base", "forgetting": "max",
                                          "ood_delta": "standard", "general_delta": "standard"}
    # no value is marked best: at 10 items and one seed against two, nothing is beyond noise
    # (test_entries_share_a_rank_unless_the_bootstrap_separates_them has the marks)
    index = (tmp_path / "site" / "index.html").read_text()
    assert index.count(' best"') == 0
    assert f'href="entries/{sft["id"]}.html"' in index
    entry = (tmp_path / "site" / "entries" / f"{sft['id']}.html").read_text()
    assert entry.count("<svg") == 2  # the heatmap and the curves
    assert (tmp_path / "site" / "raw" / sft["id"] / "s1.json").is_file()
    stored = json.loads((tmp_path / "site" / "leaderboard.json").read_text())
    assert stored["suites"][0]["entries"][0]["metrics"]["acc"]["mean"] is not None


def test_an_entry_is_a_method_with_its_addons_and_its_provenance_reproduces_them(
        tmp_path: Path) -> None:
    from clbench.results import AddOnInfo

    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    for seed in (0, 1):
        with_replay = _result(tmp_path, "sft", seed, 0.6)
        with_replay.addons = [AddOnInfo(name="replay", config={"fraction": 0.5,
                                                               "buffer_per_stage": 32},
                                        distribution="clbench", version="0.1.0",
                                        defaults={"fraction": 0.25, "buffer_per_stage": 32})]
        _write(results, f"replay-s{seed}", with_replay)
    data, problems = build([results], tmp_path / "site")
    assert problems == []
    (suite,) = data["suites"]
    replay, sft = suite["entries"]
    assert (replay["label"], replay["n"], sft["label"]) == ("sft+replay", 2, "sft")
    assert replay["addons"] == [{"name": "replay",
                                 "config": {"fraction": 0.5, "buffer_per_stage": 32}}]
    command = replay["provenance"][0]["command"]
    assert command.endswith("--addon replay --set addon.replay.fraction=0.5")  # non-defaults
    assert replay["provenance"][0]["addons"] == [
        {"name": "replay", "distribution": "clbench", "version": "0.1.0"}]
    assert "sft+replay" in (tmp_path / "site" / "index.html").read_text()


def test_a_hostile_method_name_is_escaped_everywhere(tmp_path: Path) -> None:
    results = tmp_path / "results"
    hostile = _result(tmp_path, "sft", 0, 0.5, name=HOSTILE)
    hostile.method.config = {"stop": [HOSTILE], "note": "javascript:alert(1)"}
    _write(results, "hostile", hostile)
    data, _ = build([results], tmp_path / "site")
    (entry,) = data["suites"][0]["entries"]
    assert entry["label"] == HOSTILE  # the data keeps it as it is
    pages = list((tmp_path / "site").rglob("*.html"))
    assert len(pages) == 3  # index, the entry, the comparison
    for page in pages:
        text = page.read_text()
        assert HOSTILE not in text
        assert 'href="javascript:' not in text and "src=\"javascript:" not in text
    index = (tmp_path / "site" / "index.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index
    assert all(c.isalnum() or c in "-." for c in pages[0].name)
    assert {p.name for p in (tmp_path / "site" / "entries").iterdir()} == {f"{entry['id']}.html"}


def test_a_malformed_file_is_named_and_skipped_or_refused_with_strict(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    (results / "broken.json").write_text("{not json")
    (results / "other.json").write_text(json.dumps({"schema_version": "1.0", "status": "x"}))
    runner = CliRunner()
    shown = runner.invoke(cli, ["leaderboard", "build", str(results), "--out",
                                str(tmp_path / "site")], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    assert "skipped" in shown.output and "broken.json: not a readable JSON" in shown.output
    assert "other.json" in shown.output
    assert "1 suite(s), 1 entries" in shown.output
    strict = runner.invoke(cli, ["leaderboard", "build", str(results), "--out",
                                 str(tmp_path / "site2"), "--strict"], env={"COLUMNS": "300"})
    assert strict.exit_code == 2
    assert "2 results file(s) cannot be used (--strict)" in strict.output
    assert not (tmp_path / "site2").exists()


def test_a_rebuild_writes_the_same_bytes(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for seed, acc in [(0, 0.4), (1, 0.6)]:
        _write(results, f"sdpo-s{seed}", _result(tmp_path, "sdpo", seed, acc))
    build([results], tmp_path / "a")
    build([results], tmp_path / "b")
    build([results], tmp_path / "a")  # over the site built before: replaced whole
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                     if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*")
                     if p.is_file())
    assert files_a == files_b and len(files_a) > 5
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_a_folder_of_other_files_is_not_overwritten(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    shown = CliRunner().invoke(cli, ["leaderboard", "build", str(results), "--out", str(mine)],
                               env={"COLUMNS": "300"})
    assert shown.exit_code == 2
    assert "holds other files and no leaderboard.json" in shown.output
    assert (mine / "notes.txt").read_text() == "keep me"
    missing = CliRunner().invoke(cli, ["leaderboard", "serve", str(tmp_path / "results")])
    assert missing.exit_code == 2 and "no index.html" in missing.output


def test_the_preview_server_serves_the_site(tmp_path: Path) -> None:
    import threading
    import urllib.request

    from clbench.errors import UserError
    from clbench.leaderboard.site import preview_server

    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    build([results], tmp_path / "site")
    server = preview_server(tmp_path / "site", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        with urllib.request.urlopen(f"http://{host}:{port}/index.html") as response:
            assert response.status == 200 and b"clbench leaderboard" in response.read()
        with urllib.request.urlopen(f"http://{host}:{port}/leaderboard.json") as response:
            assert json.loads(response.read())["suites"][0]["entries"][0]["label"] == "sft"
        with pytest.raises(UserError, match=f"cannot serve on port {port}"):
            preview_server(tmp_path / "site", port=port)  # taken
    finally:
        server.shutdown()
        server.server_close()


def test_the_preview_server_is_quiet_about_client_errors(tmp_path: Path, capfd) -> None:
    """A 404 and a browser that drops the connection mid-answer print nothing; a real fault
    of the server is still reported."""
    import threading
    import urllib.error
    import urllib.request

    from clbench.leaderboard.site import preview_server

    _write(tmp_path / "results", "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    build([tmp_path / "results"], tmp_path / "site")
    server = preview_server(tmp_path / "site", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{host}:{port}/no-such-page.html")
        for dropped in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")):
            try:
                raise dropped
            except ConnectionError:
                server.handle_error(None, ("127.0.0.1", 1))
        assert capfd.readouterr().err == ""
        try:
            raise RuntimeError("a fault of the server's own")
        except RuntimeError:
            server.handle_error(None, ("127.0.0.1", 1))
        assert "a fault of the server's own" in capfd.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_a_collapsed_seed_is_ranked_with_its_rows_and_flagged(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "grpo-s0", _result(tmp_path, "grpo", 0, 0.6))
    collapsed = _result(tmp_path, "grpo", 1, 0.0, status="collapsed")
    collapsed.matrix, collapsed.row_labels = collapsed.matrix[:2], collapsed.row_labels[:2]
    _write(results, "grpo-s1", collapsed)
    data, _ = build([results], tmp_path / "site")
    (entry,) = data["suites"][0]["entries"]
    assert entry["n"] == 2 and entry["flags"]["collapsed"] is True
    assert entry["matrix"]["rows"] == ["base", "after math", "after science"]
    assert entry["matrix"]["mean"][1][0] == pytest.approx(0.33)  # both seeds: 0.66 and 0
    assert entry["matrix"]["mean"][2][0] == pytest.approx(0.6)  # the seed that got there
    assert 'class="flag bad">collapse' in (tmp_path / "site" / "index.html").read_text()


def test_bad_files_and_duplicate_seeds_are_left_out_with_a_reason_not_the_board(
        tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    _write(results, "sft-s0-again", _result(tmp_path, "sft", 0, 0.9))  # another run, seed 0
    broken = _result(tmp_path, "grpo", 0, 0.4)
    path = _write(results, "grpo-s0", broken)
    data = json.loads(path.read_text())
    data["stages"] = [{"index": 1, "name": "math",  # a free-form field of the wrong shape
                       "diagnostics": {"artifacts": [1, 2]}}]
    path.write_text(json.dumps(data))
    data, problems = build([results], tmp_path / "site")
    assert [e["label"] for s in data["suites"] for e in s["entries"]] == ["sft"]
    said = " ".join(problems)
    assert "stages[0].diagnostics: artifacts should be a mapping, got list" in said
    assert "left out, two different runs of sft seed 0" in said
    with pytest.raises(UserError, match=r"2 results file\(s\) cannot be used \(--strict\)"):
        build([results], tmp_path / "site2", strict=True)


def test_the_out_folder_is_checked_and_an_old_site_survives_a_failed_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import clbench.leaderboard.site as site

    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    monkeypatch.chdir(tmp_path)
    for out, said in ((".", "the working folder"), ("results/site", "it holds, or is inside, "
                                                    "results read")):
        with pytest.raises(UserError, match=f"--out {out}: {said}"):
            build([results], out)
    build([results], tmp_path / "site")
    before = (tmp_path / "site" / "index.html").read_text()

    def fail(*args, **kwargs):
        raise RuntimeError("a crash halfway through writing the site")

    monkeypatch.setattr(site, "_write_site", fail)
    with pytest.raises(RuntimeError):
        build([results], tmp_path / "site" / "x" / "..")  # the same folder, spelt otherwise
    assert (tmp_path / "site" / "index.html").read_text() == before  # whole, as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "site"]  # nothing left


def test_entries_share_a_rank_unless_the_bootstrap_separates_them(tmp_path: Path) -> None:
    """ACC 0.9 against 0.5 and 0.49 over 400 items and two close seeds each: the first is ahead
    of both, the other two are not apart (rank 2, shared); the best mark goes to the first only,
    and to nobody among entries that no interval separates."""
    results = tmp_path / "results"
    for method, acc in (("sft", 0.9), ("grpo", 0.5), ("sdpo", 0.49)):
        for seed in (0, 1):
            _write(results, f"{method}-s{seed}",
                   _result(tmp_path, method, seed, acc + 0.005 * seed, items=400))
    data, _ = build([results], tmp_path / "site")
    (suite,) = data["suites"]
    ranks = {e["label"]: (e["rank"], e["tied"]) for e in suite["entries"]}
    assert ranks == {"sft": (1, False), "grpo": (2, True), "sdpo": (2, True)}
    best = {e["label"]: e["metrics"]["acc"]["best"] for e in suite["entries"]}
    assert best == {"sft": True, "grpo": False, "sdpo": False}
    sft = suite["entries"][0]["metrics"]["acc"]
    assert sft["item_low"] < sft["mean"] < sft["item_high"]  # the interval shown in the cell
    # the line every entry is read against: the base model's ACC (row 0 is 0.1 everywhere)
    ((model, base),) = [(b["model"], b["acc"]) for b in suite["baselines"]]
    assert model == "tiny-llama" and base == pytest.approx(0.1)
    page = (tmp_path / "site" / "index.html").read_text()
    assert page.count('<span class="tie">=</span>2') == 2
    (tmp_path / "site2").mkdir()
    for name in ("grpo-s0", "grpo-s1", "sdpo-s0", "sdpo-s1"):
        _write(tmp_path / "close", name, read_results(results / f"{name}.json"))
    data, _ = build([tmp_path / "close"], tmp_path / "site2")
    assert not any(e["metrics"]["acc"]["best"] for e in data["suites"][0]["entries"])


def test_a_superseded_suite_is_shown_apart_and_old_runs_are_flagged_not_measured(
        tmp_path: Path) -> None:
    """Runs recorded under another hash of the same suite (the suite changed since) form their
    own table, marked superseded, after the current one; runs without diagnostics say so."""
    results = tmp_path / "results"
    _write(results, "sft-s0", _result(tmp_path, "sft", 0, 0.5))
    old = _result(tmp_path, "sft", 0, 0.4)
    old.suite_hash = "sha256:" + "0" * 64  # recorded by an earlier schema of the same suite
    old.stages = []                          # and before diagnostics
    _write(results / "old", "sft-s0", old)
    data, problems = build([results], tmp_path / "site")
    assert problems == []
    assert [s["superseded"] for s in data["suites"]] == [False, True]
    assert data["suites"][1]["superseded_by"]["hash"] == data["suites"][0]["hash"]
    assert data["suites"][1]["entries"][0]["flags"]["not_measured"] is True
    assert data["suites"][0]["entries"][0]["flags"]["mixed_code"] is False
    page = (tmp_path / "site" / "index.html").read_text()
    assert page.index("Superseded suite versions") > page.index(data["suites"][0]["id"])
    assert "not measured" in page


def test_an_entry_whose_seeds_come_from_different_commits_is_flagged(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for seed, revision in ((0, "a" * 40), (1, "b" * 40 + "+dirty")):
        result = _result(tmp_path, "sft", seed, 0.5)
        result.git_revision = revision
        _write(results, f"sft-s{seed}", result)
    data, _ = build([results], tmp_path / "site")
    (entry,) = data["suites"][0]["entries"]
    assert entry["flags"]["mixed_code"] is True
    assert entry["code"] == ["clbench aaaaaaa", "clbench bbbbbbb+dirty"]
    page = (tmp_path / "site" / "entries" / f"{entry['id']}.html").read_text()
    assert "b" * 40 + "+dirty" in page  # the revision whole, its +dirty mark kept


def test_a_results_file_whose_suite_stages_are_not_a_list_still_builds(tmp_path: Path) -> None:
    """Found by the hostile-results property test: `suite.stages: null` in a complete result."""
    result = _result(tmp_path, "sft", 0, 0.5)
    path = _write(tmp_path / "results", "sft-s0", result)
    data = json.loads(path.read_text())
    data["suite"]["stages"] = None
    path.write_text(json.dumps(data))
    res = CliRunner().invoke(cli, ["leaderboard", "build", str(tmp_path / "results"), "--out",
                                   str(tmp_path / "site")])
    assert res.exit_code in (0, 2), (res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit)
