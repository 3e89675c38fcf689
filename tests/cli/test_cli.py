"""The `clbench` command through click's runner: output, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from clbench.cli import cli
from clbench.spec.suites import SuiteNotFoundError


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner(env={"COLUMNS": "160", **(env or {})}).invoke(cli, list(args))


def assert_user_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.e2e
def test_version_and_help() -> None:
    assert invoke("--version").output == "clbench, version 0.1.0\n"
    for command in (["--help"], ["list", "--help"], ["validate", "--help"], ["schema", "--help"],
                    ["tasks", "--help"], ["tasks", "show", "--help"], ["run", "--help"],
                    ["sweep", "--help"]):
        result = invoke(*command)
        assert result.exit_code == 0
        assert "Example:" in result.output, command


def test_list_methods_and_tasks(fake_plugins) -> None:
    methods = invoke("list", "methods")
    assert methods.exit_code == 0
    row = next(line for line in methods.output.splitlines() if "fake-method" in line)
    assert "A method that trains nothing (test plugin)." in row and "fake-dist" in row
    tasks = invoke("list", "tasks")
    row = next(line for line in tasks.output.splitlines() if "fake.addition" in line)
    assert [w for w in ("math", "offline", "Apache-2.0", "fake-dist") if w not in row] == []
    assert "Add two numbers (test source)." in row
    # into a pipe, one row per task whatever the width rich assumes there
    piped = invoke("list", "tasks", env={"COLUMNS": "80"}).output.splitlines()
    assert "Add two numbers (test source)." in next(line for line in piped
                                                     if "fake.addition" in line)
    # An 80-column terminal keeps every column; the description moves under the name.
    shown = invoke("list", "tasks", env={"COLUMNS": "80", "FORCE_COLOR": "1"}).output
    narrow = re.sub(r"\x1b\[[0-9;]*m", "", shown).splitlines()  # without its colours
    i = next(i for i, line in enumerate(narrow) if "fake.addition" in line)
    assert [w for w in ("math", "offline", "Apache-2.0", "fake-dist") if w not in narrow[i]] == []
    assert narrow[i + 1].strip() == "Add two numbers (test source)."


def test_list_suites(write_suite) -> None:
    path = write_suite(name="mine.yaml")
    result = invoke("list", "suites", env={"CLBENCH_SUITE_PATH": str(path.parent)})
    row = next(line for line in result.output.splitlines() if " mine " in line)
    assert "Two fake stages and one probe." in row
    assert str(path) in row  # the path whole, on the suite's line
    narrow = invoke("list", "suites", env={"CLBENCH_SUITE_PATH": str(path.parent),
                                            "COLUMNS": "60"})
    assert str(path) in next(line for line in narrow.output.splitlines() if " mine " in line)


def test_list_rejects_unknown_kind() -> None:
    result = invoke("list", "widgets")
    assert result.exit_code == 2
    assert "'widgets' is not one of 'methods', 'addons', 'tasks', 'suites'" in result.output


def test_validate_ok_and_errors(write_suite, fake_plugins) -> None:
    good = write_suite()
    bad = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 0}}
        """, name="bad.yaml")
    bad_params = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition, params: {level: 5}}, budget: {steps: 1}}
        """, name="bad_params.yaml")
    ok = invoke("validate", str(good))
    assert ok.exit_code == 0
    assert ok.output.startswith(f"OK   {good} (tiny: 2 stages, 1 probes)")

    result = invoke("validate", str(good), str(bad), str(bad_params))
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert f"OK   {good}" in result.stdout
    assert f"FAIL {bad}\n{bad}: stages[0].budget.steps (line " in result.stderr
    assert "): Input should be greater than or equal to 1" in result.stderr
    assert f"{bad_params}: stages[0].task.params.level (line 3, column 61): Input should be " \
           "less than or equal to 3" in result.stderr


def test_validate_refuses_python_tags(write_suite, tmp_path: Path) -> None:
    path = write_suite("name: !!python/object/apply:os.system ['touch x']\n", name="evil.yaml")
    result = invoke("validate", str(path))
    assert result.exit_code == 2
    assert "not valid YAML" in result.stderr and "Traceback" not in result.output


def test_schema_to_stdout_and_file(tmp_path: Path) -> None:
    result = invoke("schema")
    schema = json.loads(result.output)
    assert schema["title"] == "SuiteSpec" and "stages" in schema["required"]
    out = tmp_path / "suite.schema.json"
    assert invoke("schema", "--output", str(out)).exit_code == 0
    assert json.loads(out.read_text()) == schema


def test_a_path_that_cannot_be_written_is_one_message(tmp_path: Path) -> None:
    """A file where a folder is needed (or any OSError on a user's path): one line naming the
    path, exit 1, no traceback; --debug still shows it."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    result = invoke("schema", "--output", str(a_file / "x.json"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr == (f"error: {a_file}: is a file, so no folder can be made there "
                             "(--debug shows where)\n")
    result = invoke("export-lm-eval", str(a_file / "sub"), "--suite", "smoke")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {a_file / 'sub'}: Not a directory")
    result = invoke("--debug", "schema", "--output", str(a_file / "x.json"))
    assert isinstance(result.exception, FileExistsError)


def test_tasks_show(fake_plugins) -> None:
    result = invoke("tasks", "show", "fake.addition", "--n", "2", "--seed", "0", "--split",
                    "eval", "--set", "level=2")
    assert result.exit_code == 0, result.output
    assert "user: What is 10 + 10010?" in result.output
    assert "reference: 10 + 10010 = 10020." in result.output
    assert result.output.count("grade of the reference: reward 1.000, correct True") == 2
    assert "eval-1" in result.output and "eval-2" not in result.output
    assert "fake.addition parameters" in result.output and "level" in result.output


def test_methods_show_documents_every_config_field(monkeypatch) -> None:
    """The config's field descriptions are the CLI's documentation of a method."""
    from clbench_methods.sdpo.method import SDPO

    monkeypatch.setenv("COLUMNS", "400")  # one line per field
    result = CliRunner().invoke(cli, ["methods", "show", "sdpo"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Self-distillation policy optimisation")
    for name, info in SDPO.Config.model_fields.items():
        assert name in result.output and info.description in result.output, name
    row = next(line for line in result.output.splitlines() if "max_reprompt_tokens" in line)
    assert "10240" in row
    assert_user_error(invoke("methods", "show", "sdpp"), "unknown method 'sdpp'. Did you mean")


@pytest.mark.e2e
def test_unknown_fields_point_to_the_command_that_lists_them(write_suite, fake_plugins) -> None:
    path = str(write_suite())
    assert_user_error(invoke("run", "--suite", path, "--method", "fake-method", "--plan",
                             "--set", "method.lrr=1"),
                      "method.lrr: unknown field (check the spelling; `clbench methods show "
                      "fake-method` lists them)")
    assert_user_error(invoke("tasks", "show", "fake.addition", "--set", "levl=1"),
                      "params.levl: unknown field (check the spelling; `clbench tasks show "
                      "fake.addition` lists them)")
    assert_user_error(invoke("tasks", "show", "fake.addition", "--set", "level"),
                      "override 'level': expected KEY=VALUE, e.g. digits=3")


def test_tasks_show_errors(fake_plugins) -> None:
    assert_user_error(invoke("tasks", "show", "fake.addition", "--set", "level=9"),
                      "params.level: Input should be less than or equal to 3")
    assert_user_error(invoke("tasks", "show", "fake.adition"),
                      "unknown task source 'fake.adition'. Did you mean 'fake.addition'?")


@pytest.mark.e2e
@pytest.mark.parametrize("columns", ["160", "40"])
def test_run_plan(write_suite, fake_plugins, columns: str) -> None:
    """The plan's tables; printed into a pipe narrower than them (40 columns), no name or
    number is folded or cut."""
    path = write_suite()
    result = invoke("run", "--suite", str(path), "--method", "fake-method", "--seed", "4",
                    "--set", "stages[1].budget.steps=7", "--set", "method.beta=0.5", "--plan",
                    env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "runs/tiny/fake-method/s4" in out
    assert "model smollm2-135m (dtype auto)" in out
    add2 = [line.split() for line in out.splitlines() if line.startswith(" add2 ")]
    assert add2[0][:4] == ["add2", "fake.addition", "512", "7"]  # train items, overridden steps
    assert add2[1] == ["add2", "stream", "fake.addition", "16", "level=2"]  # its column
    # what `auto` resolves to here, without loading the model
    assert re.search(r"on this machine cpu, (fp32|bf16-mixed), \d+ threads, (glibc|jemalloc) "
                     r"malloc", out)
    assert ["add3", "ood", "fake.addition", "16", "level=3"] in [line.split() for line in
                                                                 out.splitlines()]
    assert '"lr": 1e-05' in out and '"beta": 0.5' in out  # resolved method config


def test_run_calls_the_recipe_and_prints_its_result(write_suite, fake_plugins, monkeypatch,
                                                      tmp_path: Path) -> None:
    from tests.fakes import result_of

    calls = []
    fake = types.ModuleType("clbench.run.recipe")

    def execute(run, resume, console):
        calls.append((run, resume))
        return result_of(run)

    fake.execute = execute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "clbench.run.recipe", fake)
    out = tmp_path / "out"
    result = invoke("run", "--suite", str(write_suite()), "--method", "fake-method", "--out",
                    str(out), "--resume", "--model", "tiny-llama", "--device", "cpu")
    assert result.exit_code == 0, result.output
    ((run, resume),) = calls
    assert resume is True
    assert (run.out_dir, run.model.name, run.device) == (str(out), "tiny-llama", "cpu")
    assert "method settings: fake-method's defaults" in result.output  # the CLI printed it


@pytest.mark.parametrize(("args", "fragments"), [
    (["--suite", "no-such-suite", "--method", "fake-method"], ["unknown suite 'no-such-suite'"]),
    (["--method", "fake-methd"], ["unknown method 'fake-methd'. Did you mean 'fake-method'?"]),
    (["--method", "fake-method", "--set", "method.lr=0"], ["method.lr: Input should be greater "
                                                          "than 0"]),
    (["--method", "fake-method", "--set", "stages[9].budget.steps=1"], ["stages[9] does not "
                                                                        "exist"]),
    (["--method", "fake-method", "--set", "oops"], ["expected KEY=VALUE"]),
    (["--method", "fake-method", "--device", "gpu"], ["--device 'gpu'"]),
])
def test_run_user_errors_exit_2_without_traceback(write_suite, fake_plugins, args: list[str],
                                                  fragments: list[str]) -> None:
    if "--suite" not in args:
        args = ["--suite", str(write_suite()), *args]
    assert_user_error(invoke("run", *args, "--plan"), *fragments)


@pytest.mark.e2e
def test_run_refuses_a_seed_no_generator_takes(write_suite, fake_plugins) -> None:
    result = invoke("run", "--suite", str(write_suite()), "--method", "fake-method",
                    "--seed", str(2**64), "--plan")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for '--seed': 18446744073709551616 is not in the range " \
           "-4294967295<=x<=4294967295" in result.stderr


@pytest.mark.parametrize("args", [["run", "--method", "fake-method", "--out", ""],
                                  ["run", "--method", "fake-method", "--model", " "],
                                  ["sweep", "--methods", "fake-method", "--out", ""]])
def test_an_empty_out_or_model_is_refused(write_suite, fake_plugins, tmp_path: Path,
                                          monkeypatch, args: list[str]) -> None:
    """Read as paths, they would mean the current folder: results written all over it."""
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, "--suite", str(write_suite()))
    assert result.exit_code == 2 and "must not be empty" in result.stderr
    assert not any(p.name in ("results.json", "run.json") for p in tmp_path.rglob("*"))


@pytest.mark.parametrize(("seeds", "fragment"), [
    ("0,x", "--seeds '0,x': expected comma-separated integers"),
    ("1,-4294967296", "--seeds '1,-4294967296': seeds must be between -4294967295 and "
                      "4294967295"),
    (",", "--methods and --seeds must each name at least one value"),
])
def test_sweep_refuses_bad_seeds_before_any_run(write_suite, fake_plugins, tmp_path: Path,
                                                seeds: str, fragment: str) -> None:
    result = invoke("sweep", "--suite", str(write_suite()), "--methods", "fake-method",
                    "--seeds", seeds, "--out", str(tmp_path / "grid"))
    assert_user_error(result, fragment)
    assert not (tmp_path / "grid").exists()


@pytest.mark.e2e
def test_debug_shows_the_exception(fake_plugins) -> None:
    result = invoke("--debug", "run", "--suite", "no-such-suite", "--method", "fake-method")
    assert isinstance(result.exception, SuiteNotFoundError)
    assert result.exit_code == 1


@pytest.mark.e2e
def test_ctrl_c_exits_130_without_traceback(write_suite, fake_plugins, monkeypatch) -> None:
    def interrupted(run, resume, console):
        raise KeyboardInterrupt

    fake = types.ModuleType("clbench.run.recipe")
    fake.execute = interrupted  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "clbench.run.recipe", fake)
    result = invoke("run", "--suite", str(write_suite()), "--method", "fake-method")
    assert result.exit_code == 130
    assert result.stderr == "interrupted\n" and "Traceback" not in result.output


@pytest.mark.e2e
def test_sigterm_during_a_command_exits_143_and_restores_the_handler(write_suite, fake_plugins,
                                                                     monkeypatch) -> None:
    def terminated(run, resume, console):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread
        time.sleep(5)  # the handler raises before this returns
        raise AssertionError("SIGTERM did not stop the command")

    fake = types.ModuleType("clbench.run.recipe")
    fake.execute = terminated  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "clbench.run.recipe", fake)
    before = signal.getsignal(signal.SIGTERM)
    result = invoke("run", "--suite", str(write_suite()), "--method", "fake-method")
    assert result.exit_code == 143
    assert result.stderr == "terminated\n" and "Traceback" not in result.output
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("source", ["tool_use.bfcl_simple", "math.arithmetic", "science.facts",
                                    "tool_use.generated"])
def test_tasks_show_works_offline_for_shipped_sources(source: str) -> None:
    # Evaluation-only sources (BFCL) have no train split, so the default split is `eval`.
    result = invoke("tasks", "show", source, "--n", "1")
    assert result.exit_code == 0, result.output
    assert "grade of the reference: reward 1.000, correct True" in result.output
