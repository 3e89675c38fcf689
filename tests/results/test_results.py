"""results.json: round trip, shape checks, version rules, atomic writes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fakes import result_of

from clbench import atomic
from clbench.results import (
    RESULTS_SCHEMA_VERSION,
    Cell,
    Column,
    MetricValue,
    ResultsError,
    RunResult,
    StageRecord,
    collect_versions,
    git_revision,
    new_result,
    read_results,
    write_results,
)
from clbench.spec.schema import MethodSpec, ModelSpec, RunSpec
from clbench.spec.suites import load_suite


@pytest.fixture
def run_spec(write_suite) -> RunSpec:
    suite = load_suite(write_suite())
    return RunSpec(suite=suite, method=MethodSpec(name="fake-method", params={"lr": 2e-5}),
                   model=ModelSpec(name="tiny-llama"), seed=1, out_dir="runs/x")


def filled(run_spec: RunSpec) -> RunResult:
    result = result_of(run_spec, {"lr": 2e-5, "beta": 0.0})
    result.row_labels = ["base", "after add1"]
    result.matrix = [[Cell(score=0.25, n=16, ci_low=0.06, ci_high=0.5), Cell(score=0.0, n=16),
                      None],
                     [Cell(score=0.75, n=16), Cell(score=0.125, n=16), Cell(score=0.5, n=4)]]
    result.metrics = {"bwt": MetricValue(value=None, variant="t_minus_1"),
                      "forgetting": MetricValue(value=0.1, variant="max", higher_is_better=False)}
    result.stages = [StageRecord(index=1, name="add1", summary={"loss": 1.5, "kl": float("nan")},
                                 counters={"generated_tokens": 640}, wall_time={"train": 3.5})]
    result.compute.tokens = {"generated": 640}
    return result


def test_new_result_records_provenance(run_spec: RunSpec) -> None:
    result = new_result(run_spec)
    assert result.schema_version == RESULTS_SCHEMA_VERSION == "1.6"
    assert result.status == "partial"
    assert result.suite_hash == run_spec.suite.content_hash()
    assert result.suite_spec() == run_spec.suite
    assert result.method.config == {"lr": 2e-5}
    assert result.model.spec["name"] == "tiny-llama"
    assert result.seed == 1
    assert {"python", "clbench", "torch", "pydantic"} <= set(result.versions)
    assert [(c.name, c.kind, c.stage, c.source) for c in result.columns] == [
        ("add1", "stream", 1, "fake.addition"), ("add2", "stream", 2, "fake.addition"),
        ("add3", "ood", None, "fake.addition")]


def test_round_trip(tmp_path: Path, run_spec: RunSpec) -> None:
    result = filled(run_spec)
    path = write_results(tmp_path / "run" / "results.json", result)
    back = read_results(path)
    assert back.score_matrix() == [[0.25, 0.0, None], [0.75, 0.125, 0.5]]
    assert back.matrix[0][0] == Cell(score=0.25, n=16, ci_low=0.06, ci_high=0.5)
    assert back.metrics["bwt"].value is None
    assert back.metrics["forgetting"].higher_is_better is False
    assert back.stages[0].summary == {"loss": 1.5, "kl": None}  # NaN is not JSON: stored as null
    assert back.created == result.created and back.updated >= back.created
    assert back.model_dump() == result.model_dump() | {"stages": back.model_dump()["stages"]}
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == "1.6" and raw["matrix"][0][2] is None


def test_shape_is_checked(run_spec: RunSpec) -> None:
    result = filled(run_spec).model_dump(mode="json")
    short_row = json.loads(json.dumps(result))
    short_row["matrix"][1] = short_row["matrix"][1][:2]
    with pytest.raises(ValueError, match="matrix row 1 has 2 cells for 3 columns"):
        RunResult.model_validate(short_row)
    extra_rows = json.loads(json.dumps(result))
    extra_rows["matrix"] += [extra_rows["matrix"][1]] * 2
    extra_rows["row_labels"] += ["after add2", "after add3"]
    with pytest.raises(ValueError, match="4 matrix rows for 2 stages"):
        RunResult.model_validate(extra_rows)
    with pytest.raises(ValueError, match="stream columns carry their stage index"):
        Column(name="x", kind="ood", stage=1, source="s")
    with pytest.raises(ValueError, match="ci_low 0.6 is above ci_high 0.4"):
        Cell(score=0.5, n=3, ci_low=0.6, ci_high=0.4)


def test_unknown_major_version_is_refused(tmp_path: Path, run_spec: RunSpec) -> None:
    path = write_results(tmp_path / "results.json", filled(run_spec))
    data = json.loads(path.read_text())
    data["schema_version"] = "2.0"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsError) as info:
        read_results(path)
    assert str(info.value) == (f"{path}: results schema version 2.0 is from a newer clbench; "
                               "this clbench reads 1.x. Install a clbench that reads schema 2.x "
                               "to use this file.")


def test_newer_minor_version_is_read_and_its_new_fields_ignored(tmp_path: Path,
                                                                 run_spec: RunSpec) -> None:
    path = write_results(tmp_path / "results.json", filled(run_spec))
    data = json.loads(path.read_text())
    data["schema_version"] = "1.7"
    data["energy_kwh"] = 0.3
    data["matrix"][0][0]["median"] = 0.2
    path.write_text(json.dumps(data))
    back = read_results(path)
    assert back.matrix[0][0].score == 0.25
    # The same unknown fields in a document of our own version are an error, not ignored.
    data["schema_version"] = RESULTS_SCHEMA_VERSION
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsError) as info:
        read_results(path)
    ours = RESULTS_SCHEMA_VERSION
    assert sorted(str(info.value).splitlines()) == [
        f"{path}: energy_kwh: unknown field (not part of results schema {ours})",
        f"{path}: matrix[0][0].median: unknown field (not part of results schema {ours})"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such results file"),
    ("{not json", "not a readable JSON results file"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"schema_version": 1}', "schema_version 1 is not of the form MAJOR.MINOR"),
    ('{"schema_version": "1.0", "status": "done"}', "status: Input should be 'complete', "
                                                    "'partial', 'failed' or 'collapsed'"),
])
def test_unreadable_results_are_user_errors(tmp_path: Path, content: str | None,
                                            message: str) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_results(path)


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "a.json"
    atomic.atomic_write_json(path, {"v": 1})
    atomic.atomic_write_json(path, {"v": 2, "text": "é"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"v": 2, "text": "é"}
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]  # no temporary file left


def test_crash_mid_write_leaves_old_file_intact(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "results.json"
    atomic.atomic_write_text(path, "old complete content\n")

    def crash(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # killed between writing the temporary file and the rename

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write_text(path, "new content that never lands\n")
    assert path.read_text() == "old complete content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_failed_write_names_the_file_asked_for_not_its_temporary_neighbour(
        tmp_path: Path, monkeypatch) -> None:
    import errno

    path = tmp_path / "results.json"
    atomic.atomic_write_text(path, "old\n")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", disk_full)
    with pytest.raises(OSError) as err:
        atomic.atomic_write_text(path, "new\n")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == [
        "results.json"]
    monkeypatch.undo()

    def no_temporary_file(**kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", "/x/.schema.json.abc.tmp")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", no_temporary_file)
    with pytest.raises(PermissionError) as err:
        atomic.atomic_write_text(tmp_path / "schema.json", "{}")
    assert err.value.filename == str(tmp_path / "schema.json")


def test_unserialisable_data_leaves_old_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    atomic.atomic_write_json(path, {"v": 1})
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        atomic.atomic_write_json(path, {"v": float("inf")})
    with pytest.raises(TypeError):
        atomic.atomic_write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}


def test_kill_mid_write_in_a_subprocess_never_exposes_a_partial_file(tmp_path: Path) -> None:
    import sys
    import time

    path = tmp_path / "big.json"
    atomic.atomic_write_json(path, {"old": True})
    # A child rewrites a large document in a loop; we read it meanwhile, then SIGKILL the child
    # wherever it is. A plain open-and-write fails this within a few reads (empty or cut file).
    writer = ("import sys; from clbench.atomic import atomic_write_json\n"
              "i = 0\n"
              "while True:\n"
              "    i += 1; atomic_write_json(sys.argv[1], {'i': i, 'x': 'y' * 3_000_000})")
    child = subprocess.Popen([sys.executable, "-c", writer, str(path)])
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 15
        while len(seen) < 5 and time.monotonic() < deadline:
            data = json.loads(path.read_text())  # raises on a half-written file
            if "i" in data:
                assert len(data["x"]) == 3_000_000
                seen.add(data["i"])
    finally:
        child.kill()
        child.wait()
    assert len(seen) >= 5  # we really did read while the child was rewriting
    data = json.loads(path.read_text())
    assert len(data["x"]) == 3_000_000
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["big.json"]


def test_versions_and_git_revision(tmp_path: Path) -> None:
    versions = collect_versions()
    assert versions["python"].count(".") == 2
    assert git_revision(tmp_path) is None  # not a checkout
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                               "user.email=t@t", *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (repo / "f.txt").write_text("one")
    git("add", "f.txt")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert len(head) == 40 and git_revision(repo) == head
    (repo / "f.txt").write_text("two")  # a local change to a tracked file
    assert git_revision(repo) == head + "+dirty"


def test_atomic_dir_replaces_a_folder_without_deleting_it_first(tmp_path: Path,
                                                                monkeypatch) -> None:
    """The old folder is moved aside before the new one is renamed into place, so a crash
    while a large old folder is being deleted can no longer leave no folder at all."""
    target = tmp_path / "stage1"
    with atomic.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    seen_at_delete = []
    real_rmtree = atomic.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # the only deletion left is of the moved-aside folder
        seen_at_delete.append((target / "a.txt").read_text())
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(atomic.shutil, "rmtree", rmtree)
    with atomic.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("new")
    assert seen_at_delete == ["new"]  # the new folder was in place before anything was deleted
    assert (target / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage1"]  # nothing left beside it


def test_atomic_dir_puts_the_old_folder_back_when_the_new_one_cannot_go_in(tmp_path: Path,
                                                                          monkeypatch) -> None:
    target = tmp_path / "stage1"
    with atomic.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    real_replace = atomic.os.replace

    def replace(src, dst):  # moving the old folder aside works; renaming the new one in fails
        if Path(dst) == target and "-old-" not in str(src):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), atomic.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("new")
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage1"]


def test_compute_summary_reads_out_the_cost_of_a_run() -> None:
    from types import SimpleNamespace

    from clbench.report.runs import compute_summary
    from clbench.results import Compute

    cpu = Compute(tokens={"generated_tokens": 31732, "trained_tokens": 15852, "rollouts": 768,
                          "teacher_tokens": 238736, "optimizer_steps": 48},
                  wall_time_s=12260.4, device="cpu", peak_memory_bytes=9 * 2**30)
    assert compute_summary(SimpleNamespace(compute=cpu)) == (
        "3:24:20 on cpu; peak resident memory 9.0 GiB; 48 optimizer steps; "
        "tokens: 31,732 generated, 15,852 trained, 238,736 teacher")
    gpu = Compute(tokens={"trained_tokens": 5407, "optimizer_steps": 48}, wall_time_s=243.6,
                  device="cuda:0", peak_memory_bytes=int(5.74 * 2**30))
    assert compute_summary(SimpleNamespace(compute=gpu)) == (
        "0:04:04 on cuda:0; peak GPU memory allocated 5.7 GiB; 48 optimizer steps; "
        "tokens: 5,407 trained")
    assert compute_summary(SimpleNamespace(compute=Compute())) == "not recorded"


def test_kept_time_carries_the_time_of_saved_work_to_the_next_sitting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Time up to a save point survives a stop; time after it is lost with its work; a row
    written since has counted it."""
    import clbench.results as results

    now = [100.0]
    monkeypatch.setattr(results.time, "monotonic", lambda: now[0])
    first = results.KeptTime(tmp_path, rows=1, write=True)
    assert first.carried == 0.0
    now[0] += 10
    first.saved(1)      # e.g. a step checkpoint
    now[0] += 5         # work after it, thrown away by the stop
    second = results.KeptTime(tmp_path, rows=1, write=True)
    assert second.carried == 10.0
    now[0] += 3
    second.saved(1)
    assert json.loads((tmp_path / results.KEPT_TIME_FILE).read_text()) == {
        "rows": 1, "seconds": 13.0, "peak_memory_bytes": 0}
    now[0] += 4
    assert second.lap() == 17.0 and second.lap() == 0.0  # row 1 written: counted once
    assert results.KeptTime(tmp_path, rows=2, write=True).carried == 0.0  # kept for row 1
    (tmp_path / results.KEPT_TIME_FILE).write_text("[1, 2")
    assert results.KeptTime(tmp_path, rows=1, write=True).carried == 0.0  # unreadable
    (tmp_path / results.KEPT_TIME_FILE).unlink()
    results.KeptTime(tmp_path, rows=1, write=False).saved(1)  # not the main process
    assert not (tmp_path / results.KEPT_TIME_FILE).exists()


def test_kept_time_carries_the_peak_memory_of_a_stopped_sitting(tmp_path: Path) -> None:
    """A sitting stopped between rows never wrote its peak into results.json: the save points
    keep it, the next sitting carries the largest, and a written row has counted it."""
    import clbench.results as results

    first = results.KeptTime(tmp_path, rows=2, write=True)
    first.saved(2, peak_memory_bytes=7 * 2**30)
    first.saved(2, peak_memory_bytes=6 * 2**30)  # a smaller reading keeps the larger
    second = results.KeptTime(tmp_path, rows=2, write=True)
    assert second.carried_peak == 7 * 2**30
    second.saved(2, peak_memory_bytes=2**30)  # a smaller sitting keeps the earlier peak
    assert results.KeptTime(tmp_path, rows=2, write=True).carried_peak == 7 * 2**30
    second.lap()  # row 2 written: its compute holds the peak now
    second.saved(3, peak_memory_bytes=2**30)
    assert results.KeptTime(tmp_path, rows=3, write=True).carried_peak == 2**30
    assert results.KeptTime(tmp_path, rows=4, write=True).carried_peak == 0


def test_examples_are_bounded_to_a_few_completions_of_the_runs_own_columns(
        run_spec: RunSpec) -> None:
    from clbench.results import EXAMPLES_PER_COLUMN, ExampleCompletion

    result = result_of(run_spec)
    column = result.columns[0].name
    one = ExampleCompletion(id="3", completion="12", correct=True)
    result.examples = {column: [one] * EXAMPLES_PER_COLUMN}
    RunResult.model_validate(result.model_dump())  # within bounds
    with pytest.raises(ValueError, match="at most 2 completions"):
        RunResult.model_validate({**result.model_dump(),
                                  "examples": {column: [one.model_dump()] * 3}})
    with pytest.raises(ValueError, match="at most 2 completions of one of the run's columns"):
        RunResult.model_validate({**result.model_dump(),
                                  "examples": {"no-such-column": [one.model_dump()]}})
    with pytest.raises(ValueError, match="at most 1500 characters"):
        ExampleCompletion(id="3", completion="x" * 1501, correct=False)
