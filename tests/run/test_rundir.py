"""The run directory's identity across clbench versions: a run folder written before a field was
added (at its default) is still this run; a real difference is refused and named by its path."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fakes import old_suite_hash, result_of, run_spec, smoke_run

from clbench.plugins import registry
from clbench.results import RESULTS_FILENAME, Cell, read_results, write_results
from clbench.run.rundir import IDENTITY_FILE, RunDirError, check_run_dir, run_identity


def _run(tmp_path: Path, *overrides: str):
    return smoke_run(tmp_path, *overrides)


def _older_identity(identity: dict) -> dict:
    """`identity` as a clbench without `model.mixed_precision` and the method's `warmup_steps`
    would have written it."""
    old = copy.deepcopy(identity)
    del old["suite_spec"]["model"]["mixed_precision"]
    del old["model"]["mixed_precision"]
    del old["method_config"]["warmup_steps"]
    old["suite_hash"] = old_suite_hash(old["suite_spec"])
    return old


def _write(run_dir: Path, identity: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / IDENTITY_FILE).write_text(json.dumps(identity))


def test_a_field_added_at_its_default_does_not_make_another_run(tmp_path: Path) -> None:
    run = _run(tmp_path)
    now = run_identity(run)
    old = _older_identity(now)
    assert old["suite_hash"] != now["suite_hash"]  # the hash alone would refuse it
    _write(tmp_path / "run", old)
    assert check_run_dir(tmp_path / "run", now, resume=True) is None  # no results yet: fresh


def test_a_field_added_with_another_value_is_a_difference_named_by_path(tmp_path: Path) -> None:
    run = _run(tmp_path, "model.mixed_precision=false")
    now = run_identity(run)
    default_run = _run(tmp_path)
    _write(tmp_path / "run", _older_identity(run_identity(default_run)))
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "run", now, resume=True)
    message = str(err.value)
    assert "model.mixed_precision: true there, false now" in message
    assert "suite_hash" not in message  # the suite is compared field by field


def test_a_field_that_changed_the_method_reads_as_it_was_in_older_runs(tmp_path: Path) -> None:
    """sdpo's `feedback_with_demo` came with a default that changes what the
    teacher sees: a run recorded before it did the opposite, so resuming it under the new
    default is refused by name, and resuming with the old value is the same run."""
    run = run_spec("smoke", "sdpo", seed=0, out_dir=tmp_path / "run")
    config = registry.validate_method_params("sdpo", run.method.params).model_dump(mode="json")
    assert config["feedback_with_demo"] is False
    old = copy.deepcopy(run_identity(run))
    del old["method_config"]["feedback_with_demo"]
    _write(tmp_path / "run", old)
    with pytest.raises(RunDirError) as refused:
        check_run_dir(tmp_path / "run", run_identity(run), resume=True)
    message = str(refused.value)
    assert "method.feedback_with_demo: true there, false now" in message
    assert "to continue it, add --set method.feedback_with_demo=true (a setting this run " \
        "predates and did not record" in message
    as_before = run_spec("smoke", "sdpo", seed=0, out_dir=tmp_path / "run", overrides=[
        "method.feedback_with_demo=true"])
    assert check_run_dir(tmp_path / "run", run_identity(as_before),
                         resume=True) is None


def test_a_run_from_before_the_evaluation_settings_resumes_only_as_it_evaluated(
        tmp_path: Path) -> None:
    run = run_spec("smoke", "sft", seed=0, out_dir=tmp_path / "run")
    old = copy.deepcopy(run_identity(run))
    for field in ("eval_weights", "eval_batching", "eval_drafts"):
        del old["model"][field]
    _write(tmp_path / "run", old)
    with pytest.raises(RunDirError) as refused:
        check_run_dir(tmp_path / "run", run_identity(run), resume=True)
    message = str(refused.value)
    assert "model.eval_weights: master there, compute now" in message
    assert "--set model.eval_weights=master" in message  # eval_drafts: 0 then and now
    assert "eval_drafts" not in message
    as_before = run_spec("smoke", "sft", seed=0, out_dir=tmp_path / "run", overrides=[
        "model.eval_weights=master", "model.eval_batching=suite"])
    assert check_run_dir(tmp_path / "run", run_identity(as_before), resume=True) is None


@pytest.mark.parametrize("config", ["abc", [1, 2], 5, None])
def test_a_damaged_stored_method_config_is_a_difference_not_a_crash(tmp_path: Path,
                                                                    config: Any) -> None:
    run = run_spec("smoke", "sdpo", seed=0, out_dir=tmp_path / "run")
    now = run_identity(run)
    _write(tmp_path / "run", {**now, "method_config": config})
    if config is None:  # no settings recorded: the defaults, with the values from before
        match = "method.feedback_with_demo: true there"
    else:
        match = "method_config: .* there"
    with pytest.raises(RunDirError, match=match):
        check_run_dir(tmp_path / "run", now, resume=True)


def test_a_changed_budget_is_named_not_hashed(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _write(tmp_path / "run", run_identity(run))
    other = _run(tmp_path, "stages[0].budget.steps=7")
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "run", run_identity(other), resume=True)
    steps = run.suite.stages[0].budget.steps
    assert (f"holds another run (stages[0].budget.steps: {steps} there, 7 now); to continue "
            f"it, add --set 'stages[0].budget.steps={steps}'; or ") in str(err.value)
    # a string YAML would read as a number is quoted, so the hint gives back that very string
    versioned = _run(tmp_path, "version=\"2\"")
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "run", run_identity(versioned), resume=True)
    assert f"""add --set 'version="{run.suite.version}"'; or""" in str(err.value)
    from clbench.spec.reading import parse_override
    assert parse_override(f'version="{run.suite.version}"')[1] == run.suite.version
    with pytest.raises(RunDirError) as err:  # the default metrics: too long a list to type
        check_run_dir(tmp_path / "run", run_identity(_run(tmp_path, "protocol.metrics=[acc]")),
                      resume=True)
    assert "protocol.metrics: " in str(err.value) and "--set" not in str(err.value)
    two = _run(tmp_path, "protocol.metrics=[acc, bwt]")
    (tmp_path / "run" / IDENTITY_FILE).unlink()
    _write(tmp_path / "run", run_identity(two))
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "run", run_identity(_run(tmp_path, "protocol.metrics=[acc]")),
                      resume=True)
    assert """add --set 'protocol.metrics=["acc", "bwt"]'; or""" in str(err.value)  # quoted
    assert parse_override('protocol.metrics=["acc", "bwt"]')[1] == ["acc", "bwt"]


def test_the_suite_files_own_model_is_named_apart_and_not_hinted(tmp_path: Path) -> None:
    """`--set model.*` sets the run's model, not the `model:` of the suite file: when the file's
    model changed, a hint to set it would only come back refused."""
    run = _run(tmp_path)
    _write(tmp_path / "run", run_identity(run))
    now = run_identity(run)
    now["suite_spec"]["model"]["name"] = "tiny-qwen2"  # the suite file now names another model
    with pytest.raises(RunDirError) as err:
        check_run_dir(tmp_path / "run", now, resume=True)
    message = str(err.value)
    assert f"the suite's model.name: {run.suite.model.name} there, tiny-qwen2 now" in message
    assert "--set" not in message


def test_an_identity_without_the_suite_reads_it_from_results(tmp_path: Path) -> None:
    run = _run(tmp_path)
    now = run_identity(run)
    old = _older_identity(now)
    suite = old.pop("suite_spec")  # identities did not store the suite before
    _write(tmp_path / "run", old)
    # Without results.json there is only the old hash to go by: refused.
    with pytest.raises(RunDirError, match="suite_hash"):
        check_run_dir(tmp_path / "run", now, resume=True)
    # The results of the first rows hold the suite as run: read through the current schema it
    # is this suite, so the run resumes.
    result = result_of(run)
    result.suite = suite
    write_results(tmp_path / "run" / RESULTS_FILENAME, result)
    previous = check_run_dir(tmp_path / "run", now, resume=True)
    assert previous is not None and previous.status == "partial"


def test_rewording_the_description_is_the_same_suite_and_run(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _write(tmp_path / "run", run_identity(run))
    reworded = _run(tmp_path, "description=Another way to say it.")
    assert reworded.suite.description != run.suite.description
    assert reworded.suite.content_hash() == run.suite.content_hash()
    assert check_run_dir(tmp_path / "run", run_identity(reworded), resume=True) is None
    changed = _run(tmp_path, 'version="2"')  # the content's own version is measured
    assert changed.suite.content_hash() != run.suite.content_hash()


@pytest.mark.parametrize("content", ["{\"suite\": ", "[1, 2]", "\udcff"])
def test_a_damaged_identity_file_is_a_clear_refusal(tmp_path: Path, content: str) -> None:
    run = _run(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / IDENTITY_FILE).write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(RunDirError, match=r"run.json is damaged .*restore it or choose another"):
        check_run_dir(tmp_path / "run", run_identity(run), resume=True)


@pytest.mark.e2e
def test_a_run_another_process_is_running_is_refused(tmp_path: Path) -> None:
    """Two processes resuming one run would write over each other's stages; the second is
    refused while the first holds the folder, and proceeds once it is released."""
    from fakes import SUITE, run_cli, write_suite

    from clbench.run.rundir import LOCK_FILE, lock_run_dir

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    out = tmp_path / "run"
    args = ["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
            "--out", str(out), "--resume"]
    held = lock_run_dir(out)  # as the running process holds it (flock: per open file)
    try:
        res = run_cli(args)
        assert res.exit_code == 2, res.output
        assert "another clbench process is running the run in" in " ".join(res.output.split())
        assert "Traceback" not in res.output
        assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # nothing written
        with pytest.raises(RunDirError, match="another clbench process"):
            lock_run_dir(out)
    finally:
        held.close()
    res = run_cli(args)  # the lock file left behind does not make the folder "another run"
    assert res.exit_code == 0, res.output
    assert (out / RESULTS_FILENAME).is_file()

    # Without --resume, a run being run elsewhere is not answered "pass --resume" (which the
    # lock would then refuse), and a finished, idle one is.
    fresh = [a for a in args if a != "--resume"]
    held = lock_run_dir(out)
    try:
        res = run_cli(fresh)
    finally:
        held.close()
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "another clbench process is running this run in" in said
    assert "pass --resume" not in said
    res = run_cli(fresh)
    assert res.exit_code == 2, res.output
    assert "already holds this run; pass --resume" in " ".join(res.output.split())


@pytest.mark.e2e
def test_a_folder_that_cannot_be_locked_is_refused_on_every_rank(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The main process's failure to lock (a read-only folder, say) goes to every rank through
    the broadcast: a rank left waiting in it while the main one raised would hang the launch."""
    from fakes import SUITE, run_cli, write_suite

    from clbench.run import recipe, rundir

    def unlockable(run_dir: Path) -> None:
        raise PermissionError(13, "Permission denied", str(run_dir / ".running"))

    real = recipe.make_distributed
    broadcasts = []

    def recording(run):  # the single-process helper, its broadcasts recorded
        dist = real(run)
        original = dist.broadcast
        dist.broadcast = lambda obj: broadcasts.append(obj) or original(obj)
        return dist

    monkeypatch.setattr(rundir, "lock_run_dir", unlockable)
    monkeypatch.setattr(recipe, "make_distributed", recording)
    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    res = run_cli(["run", "--suite", str(suite), "--method", "test.echo-sft", "--device", "cpu",
                   "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "cannot create or lock the run folder" in " ".join(res.output.split())
    assert "Permission denied" in res.output
    assert len(broadcasts) == 1 and "Permission denied" in broadcasts[0]


@pytest.mark.e2e
def test_a_mistake_found_before_anything_is_computed_leaves_the_folder_free(
        tmp_path: Path) -> None:
    """A training set a hub source cannot give (known only once its data is loaded), or a model
    that does not load, is refused before the folder is claimed and before row 0: the
    corrected command may use the same --out."""
    from fakes import PLUGINS, SUITE, EchoDigit, write_suite

    from clbench.cli import cli
    from clbench.tasks.base import TaskSizeError

    class EvalOnlyHubDigit(EchoDigit):
        origin = "hub"  # its items are checked when the run draws them, not by validation

        def build(self, split: str, seed: int, size: int) -> list:
            if split == "train":
                raise TaskSizeError(f"has no train items, {size} were asked for")
            return super().build(split, seed, size)

    plugins = {**PLUGINS, "tasks": {**PLUGINS["tasks"], "test.hub-digit": EvalOnlyHubDigit}}

    def run(*extra: str) -> Any:
        with registry.extra_plugins(**plugins):
            return CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method",
                                            "test.echo-sft", "--device", "cpu", "--out", str(out),
                                            *extra])

    suite = write_suite(tmp_path, SUITE.replace("steps: 8", "steps: 1"))
    out = tmp_path / "runs" / "echo" / "run"
    res = run("--set", "stages[1].task.source=test.hub-digit")
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "stage 'high' (stages[1].task.train_size=20): has no train items" in said
    assert "base" not in said  # refused before row 0 was evaluated
    assert not (tmp_path / "runs").exists()  # the folders it made for the run are gone again
    res = run("--model", "tiny-lama")
    assert res.exit_code == 2, res.output
    assert "unknown tiny model 'tiny-lama'" in res.output
    assert not (tmp_path / "runs").exists()
    out.mkdir(parents=True)
    res = run("--model", "tiny-lama")
    assert res.exit_code == 2, res.output
    assert out.is_dir() and list(out.iterdir()) == []  # a folder it did not make is left
    res = run()
    assert res.exit_code == 0, res.output
    assert read_results(out / RESULTS_FILENAME).status == "complete"


def test_a_folder_of_another_run_that_completed_no_stage_is_refused_with_the_way_out(
        tmp_path: Path) -> None:
    """A run that failed in stage 1 holds only row 0 (cached elsewhere): the refusal says it can
    be deleted; a folder with a completed stage is refused without that suggestion."""
    run = _run(tmp_path)
    other = run_spec("smoke", "sft", seed=1, out_dir=tmp_path / "run")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / IDENTITY_FILE).write_text(json.dumps(run_identity(other)))
    result = result_of(other)
    row = [Cell(score=0.5, n=2)] * len(result.columns)
    result.status, result.matrix, result.row_labels = "failed", [row], ["base"]
    write_results(folder / RESULTS_FILENAME, result)
    with pytest.raises(RunDirError) as err:
        check_run_dir(folder, run_identity(run), resume=True)
    assert str(err.value).endswith(f"it is a failed run that completed no stage: delete it "
                                   f"(rm -r {folder}) to start over there, or choose another --out")
    result.status, result.matrix = "partial", [row, row]
    result.row_labels.append("after math")
    write_results(folder / RESULTS_FILENAME, result)
    with pytest.raises(RunDirError) as err:
        check_run_dir(folder, run_identity(run), resume=True)
    assert "rm -r" not in str(err.value)
    assert str(err.value).endswith("seed: 1 there, 0 now); choose another --out")


def test_a_lock_file_removed_by_its_holder_is_not_locked_twice(tmp_path: Path) -> None:
    """A process that opened the lock file just before its holder removed it must not end up
    holding a lock on the removed file while a third process locks the new one."""
    import fcntl

    from clbench.atomic import lock_is_held, try_file_lock

    path = tmp_path / ".running"
    holder = try_file_lock(path)
    assert holder is not None and lock_is_held(path)
    late = open(path, "a")  # opened before the holder removes the file...
    path.unlink()
    holder.close()
    fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ...so it can lock the removed file
    third = try_file_lock(path)
    assert third is not None  # the file at `path` is new and free
    assert try_file_lock(path) is None  # and now held
    late.close()
    third.close()
    assert not lock_is_held(path)
    assert not lock_is_held(tmp_path / "absent")


def test_a_locked_read_only_run_folder_is_probed_without_writing(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """A complete run kept read-only still answers "already holds this run" (the probe opens
    the lock file read-only); under the run's own lock the probe is not mistaken for another
    process."""
    import os

    from clbench.run.rundir import LOCK_FILE, lock_run_dir

    run = _run(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / IDENTITY_FILE).write_text(json.dumps(run_identity(run)))
    (folder / LOCK_FILE).write_text("")
    os.chmod(folder / LOCK_FILE, 0o444)
    real_open = open

    def no_writes(file, mode="r", *args, **kwargs):  # root ignores chmod: refuse writes here
        if str(file).endswith(LOCK_FILE) and any(c in mode for c in "wa+"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    import builtins

    monkeypatch.setattr(builtins, "open", no_writes)
    with pytest.raises(RunDirError, match="already holds this run; pass --resume"):
        check_run_dir(folder, run_identity(run), resume=False)
    monkeypatch.undo()
    os.chmod(folder / LOCK_FILE, 0o644)
    mine = lock_run_dir(folder)
    try:
        with pytest.raises(RunDirError, match="already holds this run; pass --resume"):
            check_run_dir(folder, run_identity(run), resume=False, locked_by_us=True)
        with pytest.raises(RunDirError, match="another clbench process is running this run"):
            check_run_dir(folder, run_identity(run), resume=False)
    finally:
        mine.close()


@pytest.mark.parametrize("case", ["running", "checkpoint", "unreadable results", "complete"])
def test_no_delete_hint_for_a_folder_that_may_hold_something(tmp_path: Path, case: str) -> None:
    from clbench.run.rundir import LOCK_FILE, lock_run_dir

    run = _run(tmp_path)
    other = run_spec("smoke", "sft", seed=1, out_dir=tmp_path / "run")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / IDENTITY_FILE).write_text(json.dumps(run_identity(other)))
    result = result_of(other)
    result.matrix, result.row_labels = [[Cell(score=0.5, n=2)] * len(result.columns)], ["base"]
    result.status = "complete" if case == "complete" else "partial"
    write_results(folder / RESULTS_FILENAME, result)
    held = None
    if case == "running":
        held = lock_run_dir(folder)
    elif case == "checkpoint":
        (folder / "checkpoints" / "stage1").mkdir(parents=True)
    elif case == "unreadable results":
        (folder / RESULTS_FILENAME).write_text('{"schema_version": "99.0"}')
    try:
        with pytest.raises(RunDirError) as err:
            check_run_dir(folder, run_identity(run), resume=True)
    finally:
        if held is not None:
            held.close()
    assert "rm -r" not in str(err.value)
    assert str(err.value).endswith("seed: 1 there, 0 now); choose another --out")
    assert (folder / LOCK_FILE).exists() == (case == "running")
