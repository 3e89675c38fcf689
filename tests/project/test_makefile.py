"""What `make run` runs: the starter benchmark, under jemalloc where the system has it."""

from __future__ import annotations

import subprocess

from where import REPO


def _run_command(*variables: str) -> str:
    """The command `make run` would run with these variables (make -n prints it unrun)."""
    printed = subprocess.run(["make", "-n", "run", *variables], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    lines = printed.replace("\\\n", " ").splitlines()
    return next(line for line in lines if "clbench run" in line)


def test_make_run_preloads_the_jemalloc_it_is_given_and_none_when_told_not_to() -> None:
    preloaded = _run_command("JEMALLOC=/opt/lib/libjemalloc.so.2")
    assert preloaded.startswith("LD_PRELOAD=/opt/lib/libjemalloc.so.2 ")
    assert "--suite starter --method sdpo" in preloaded
    plain = _run_command("JEMALLOC=")
    assert "LD_PRELOAD" not in plain
    assert plain.split()[1:3] == ["run", "--suite"]


def test_make_run_finds_the_jemalloc_that_clbench_finds() -> None:
    from clbench.train.cpu import system_jemalloc

    found = system_jemalloc()
    default = _run_command()
    if found is None:
        assert "LD_PRELOAD" not in default
    else:
        assert default.startswith(f"LD_PRELOAD={found} ")
