"""No code runs from a suite or a results file, a model's own code runs only by an explicit flag
(recorded), and no name from a plugin or a file leads out of the run's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import result_of, run_spec

from clbench.cli import cli
from clbench.results import read_results, write_results
from clbench.spec.options import RunOptions
from clbench.spec.reading import SpecError
from clbench.spec.suites import default_out_dir, resolve_suite


def _smoke_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(resolve_suite("smoke").read_text() + extra)
    return path


def test_a_suite_or_an_override_cannot_let_a_model_run_its_own_code(tmp_path: Path) -> None:
    suite = _smoke_with(tmp_path, "")
    text = suite.read_text().replace("model:\n", "model:\n  trust_remote_code: true\n", 1)
    assert "trust_remote_code: true" in text
    suite.write_text(text)
    planned = CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method", "sft", "--plan"])
    assert planned.exit_code == 2
    assert "pass --trust-remote-code" in " ".join(planned.output.split())
    validated = CliRunner().invoke(cli, ["validate", str(suite)])  # refused alike
    assert validated.exit_code == 2
    assert "model (line" in validated.output and "cannot let a model run its own code" in \
        " ".join(validated.output.split())
    with pytest.raises(SpecError, match="a suite or an override cannot let a model run"):
        run_spec("smoke", "sft", overrides=["model.trust_remote_code=true"])


def test_the_flag_allows_it_is_recorded_and_reaches_a_sweeps_children(tmp_path: Path) -> None:
    plain = run_spec("smoke", "sft", out_dir=tmp_path / "a")
    allowed = run_spec("smoke", "sft", out_dir=tmp_path / "b", trust_remote_code=True)
    assert plain.model.trust_remote_code is False and allowed.model.trust_remote_code is True
    assert result_of(allowed, {}).model.spec["trust_remote_code"] is True  # in results.json
    # a sweep's child gets its run's options as a command line
    assert "--trust-remote-code" in RunOptions(suite="smoke", method="sft",
                                               trust_remote_code=True).command_line()
    assert "--trust-remote-code" not in RunOptions(suite="smoke", method="sft").command_line()
    planned = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "sft", "--plan",
                                       "--trust-remote-code"])
    assert planned.exit_code == 0, planned.output


def test_a_suite_cannot_build_python_objects(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    suite = _smoke_with(tmp_path, f"x: !!python/object/apply:os.system ['touch {marker}']\n")
    result = CliRunner().invoke(cli, ["validate", str(suite)])
    assert result.exit_code == 2 and not marker.exists()


def test_names_cannot_lead_out_of_the_runs_folder() -> None:
    assert default_out_dir("starter", "pkg.mod:Class", 0) == "runs/starter/pkg.mod.Class/s0"
    for suite, method in [("starter", "../../etc"), ("..", "sft"), ("starter", "a/b"),
                          ("starter", "..")]:
        with pytest.raises(SpecError, match="cannot name a run folder"):
            default_out_dir(suite, method, 0)


def test_a_results_file_whose_column_names_a_path_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"id": "x", "completion": "the secret", "correct": true}\n')
    run = run_spec("smoke", "sft", out_dir=tmp_path / "unused")
    path = write_results(tmp_path / "runs" / "a" / "results.json", result_of(run, {}))
    data = json.loads(path.read_text())
    data["columns"][0]["name"] = "../../../secret"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"columns\[0\]\.name"):
        read_results(path)
    built = CliRunner().invoke(cli, ["leaderboard", "build", str(tmp_path / "runs"), "--out",
                                     str(tmp_path / "site")])
    assert "columns[0].name" in " ".join(built.output.split())
    site = tmp_path / "site"
    assert not site.exists() or "the secret" not in "".join(
        p.read_text(errors="replace") for p in site.rglob("*") if p.is_file())


def test_an_unknown_method_that_looks_like_a_path_creates_nothing(tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", "../../escape"])
    assert result.exit_code == 2
    assert not (tmp_path.parent / "escape").exists() and not (tmp_path / "runs").exists()


@pytest.fixture
def marker_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on the path whose import writes a marker file: if it exists after a command,
    that command ran code a file named."""
    import sys

    marker = tmp_path / "ran"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "clbench_marker_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from clbench_methods.sft import SFT\n\n\nclass Thing(SFT):\n    name = 'thing'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    monkeypatch.delitem(sys.modules, "clbench_marker_mod", raising=False)
    return marker


def test_a_method_location_in_a_suite_or_results_file_is_never_imported(
        tmp_path: Path, marker_module: Path) -> None:
    location = "clbench_marker_mod:Thing"
    suite = _smoke_with(tmp_path, f"  {location}: {{}}\n")  # in the suite's `methods:` block
    assert "methods:\n  sdpo: {feedback: rich}" in suite.read_text()
    for args in (["validate", str(suite)],
                 ["run", "--suite", str(suite), "--method", "sft", "--plan"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, res.output
        assert "imported only when given to --method, never when a file names it" in \
            " ".join(res.output.split())
    result = result_of(run_spec("smoke", "sft", out_dir=tmp_path / "unused"))
    result.method.name = location
    result.status = "complete"
    results = tmp_path / "results"
    write_results(results / "a" / "results.json", result)
    for args in (["report", str(results)], ["report", str(results), "--json"],
                 ["leaderboard", "build", str(results), "--out", str(tmp_path / "site")]):
        CliRunner().invoke(cli, args)
    assert not marker_module.exists()
    # typed on the command line, the same location is the user's own code: it is imported
    res = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method", location, "--plan"])
    assert res.exit_code == 0, res.output
    assert marker_module.exists()


@pytest.mark.e2e
def test_an_lm_eval_task_folder_runs_its_python_only_with_allow_task_code(tmp_path: Path
                                                                         ) -> None:
    """A probe's `include_path` with a `utils.py` (and a task that calls it through
    `!function`) is refused by `validate` and by `run` before lm-eval reads the folder, unless
    the command line says --allow-task-code; then lm-eval runs it and the run completes."""
    import shutil

    from where import FIXTURES

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(FIXTURES / "lmeval" / "mc_a.jsonl", tasks / "mc_a.jsonl")
    text = (FIXTURES / "lmeval" / "mc_a.yaml").read_text().replace(
        "task: fixture_mc_a", "task: coded_mc\nprocess_docs: !function utils.process_docs")
    (tasks / "coded.yaml").write_text(text)
    marker = tmp_path / "ran"
    (tasks / "utils.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\n"
                                    "def process_docs(dataset):\n    return dataset\n")
    suite = _smoke_with(tmp_path, "")
    suite.write_text(suite.read_text().replace("protocol:\n", (
        "  - name: general\n    kind: general\n    lm_eval: {task: coded_mc, include_path: "
        "tasks, limit: 2}\nprotocol:\n"), 1))
    validated = CliRunner().invoke(cli, ["validate", str(suite)])
    said = " ".join(validated.output.split())
    assert validated.exit_code == 2 and "probes[1].lm_eval (line" in said
    assert "its task files carry Python that lm-eval would run " \
        f"({tasks / 'coded.yaml'}, {tasks / 'utils.py'})" in said
    assert "pass --allow-task-code if you trust it" in said
    out = tmp_path / "run"
    refused = CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method", "sft",
                                       "--out", str(out)])
    assert refused.exit_code == 2 and "--allow-task-code" in refused.output
    assert not marker.exists() and not out.exists()
    assert CliRunner().invoke(cli, ["validate", str(suite), "--allow-task-code"]).exit_code == 0
    allowed = CliRunner().invoke(cli, ["run", "--suite", str(suite), "--method", "sft", "--out",
                                       str(out), "--allow-task-code", "--no-base-cache"])
    assert allowed.exit_code == 0, allowed.output
    assert marker.exists() and read_results(out / "results.json").status == "complete"


def test_python_m_clbench_cli_imports_nothing_from_the_working_folder(tmp_path: Path) -> None:
    """`python -m` puts the working folder first on the import path: a `rich.py` lying in a
    results folder would be imported in place of the library (and run) by `python -m
    clbench.cli report .`, how a sweep's and accelerate's processes start."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    for module in ("rich", "yaml", "click"):
        (tmp_path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = subprocess.run([sys.executable, "-m", "clbench.cli", "list", "suites"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "starter" in done.stdout and not marker.exists()


def test_terminal_escapes_in_a_suite_reach_no_terminal(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A suite someone else wrote: YAML's `\\e` escapes in its description reach `list
    suites` as text, and its errors name it without them."""
    import re

    smoke = resolve_suite("smoke").read_text()
    text = re.sub(r"description: >-\n(  .*\n)+",
                  lambda _: 'description: "\\e]0;owned\\a\\e[2J mine"\n', smoke, count=1)
    assert "\\e]0;owned" in text
    (tmp_path / "escapes.yaml").write_text(text)
    (tmp_path / "broken.yaml").write_text(text.replace("steps: 2", 'steps: "\\e[2J"', 1))
    monkeypatch.setenv("CLBENCH_SUITE_PATH", str(tmp_path))
    listed = CliRunner().invoke(cli, ["list", "suites"])
    assert listed.exit_code == 0 and "]0;owned" in listed.output and " mine" in listed.output
    refused = CliRunner().invoke(cli, ["validate", str(tmp_path / "broken.yaml")])
    assert refused.exit_code == 2 and "stages[0].budget.steps" in refused.output
    for said in (listed.output, refused.output):
        assert "\x1b" not in said and "\x07" not in said


def test_report_and_leaderboard_build_import_no_plugin_and_no_torch(tmp_path: Path) -> None:
    """They read recorded data alone: run in a fresh interpreter on results of a built-in
    method with an add-on, neither command discovers an entry point or imports a plugin."""
    import subprocess
    import sys

    from clbench.results import Cell
    from clbench.run.scores import metric_values

    run = run_spec("smoke", "sdpo", out_dir=tmp_path / "unused", addons=["replay"],
                   overrides=["method.lr=3e-6"])
    result = result_of(run)
    result.matrix = [[Cell(score=score, n=8) for _ in result.columns]
                     for score in (0.1, 0.5, 0.4)]
    result.row_labels = ["base", "after math", "after science"]
    result.metrics, result.status = metric_values(result, run.suite.protocol), "complete"
    write_results(tmp_path / "results" / "a" / "results.json", result)
    probe = ("import sys\nfrom clbench.cli import cli\nfrom clbench.plugins import registry\n"
             "code = cli.main(sys.argv[1:], standalone_mode=False)\n"
             "found = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('clbench_methods', 'clbench_addons') or m.startswith('clbench.tasks.'))\n"
             "print('PLUGINS', found, sorted(registry._entries), sorted(registry._loaded))\n"
             "stack = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'accelerate'))\n"
             "print('STACK', stack)\n"
             "sys.exit(code)\n")
    said = {}
    for args in (["report", "results"], ["report", "results", "--json"],
                 ["leaderboard", "build", "results", "--out", "site"]):
        done = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "COLUMNS": "200"})
        assert done.returncode == 0, done.stderr
        assert "PLUGINS [] [] []" in done.stdout, (args, done.stdout[-2000:])
        # reading recorded results needs no training stack: the board builds where torch is not
        assert "STACK []" in done.stdout, (args, done.stdout[-2000:])
        said[" ".join(args)] = done.stdout
    # its settings (`--set`, the suite's `methods:` block) told apart from its recorded defaults
    assert 'settings: lr=3e-06, feedback="rich"; replay: its defaults' in said["report results"]
