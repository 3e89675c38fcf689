"""What a wheel of clbench contains: every package of the source tree (setuptools' list is
explicit, so a new subpackage left out of it would be missing from an installed clbench)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration  # reads TOML on Python 3.10 too
from where import REPO

ROOT = REPO


def test_every_package_is_in_the_wheel() -> None:
    config = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "data" in init.relative_to(base).parts:
                continue
            parts = init.parent.relative_to(base).parts
            found.add(".".join((name, *parts)))
    assert found == listed


def test_a_wheel_ships_the_named_suites_the_task_data_and_the_leaderboard_templates(
        tmp_path: Path) -> None:
    """Built from a copy of the sources (the checkout stays clean): the suites that `--suite
    NAME` finds, the offline data of the shipped tasks and the leaderboard's templates and
    assets are in the wheel; the published results are not."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("clbench", "methods", "addons", "suites", "leaderboard"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(src)], check=True)
    (wheel,) = (tmp_path / "dist").glob("clbench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    suites = {f"clbench_suites/{p.name}" for p in (ROOT / "suites").glob("*.yaml")}
    assert suites and suites <= names, sorted(n for n in names if "suite" in n)
    data = {"clbench/" + p.relative_to(ROOT / "clbench").as_posix()
            for p in (ROOT / "clbench" / "data").rglob("*") if p.is_file()
            and "__pycache__" not in p.parts}
    assert data and data <= names, sorted(data - names)[:5]
    site = {"clbench_leaderboard/" + p.relative_to(ROOT / "leaderboard").as_posix()
            for folder in ("templates", "assets")
            for p in (ROOT / "leaderboard" / folder).iterdir()}
    assert site and site <= names, sorted(site - names)
    assert not any(n.startswith("clbench_leaderboard/results/") for n in names)


def test_named_suites_are_found_where_clbench_suites_is_installed() -> None:
    import clbench_suites
    from clbench.spec.suites import resolve_suite, suite_dirs

    shipped = Path(clbench_suites.__file__).resolve().parent
    assert shipped in [d.resolve() for d in suite_dirs()]
    assert resolve_suite("starter") == shipped / "starter.yaml"


def test_the_plugins_contract_covers_every_plugin_and_every_module_but_the_api() -> None:
    """The import-linter contract that keeps plugins on `clbench.api` names modules explicitly:
    a module added to clbench, or a plugin package added to the repository, must join it."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (plugins,) = [c for c in contracts["contracts"] if c["type"] == "forbidden"]
    modules = {f"clbench.{p.stem}" for p in (ROOT / "clbench").iterdir()
               if (p.suffix == ".py" or (p / "__init__.py").is_file())
               and p.stem not in ("__init__", "api")}
    assert set(plugins["forbidden_modules"]) == modules
    examples = {init.parent.name
                for init in (ROOT / "examples" / "plugins").glob("*/*/__init__.py")}
    assert set(plugins["source_modules"]) == {"clbench_methods", "clbench_addons", *examples}
    assert plugins.get("allow_indirect_imports") is True  # what they import, not what it imports
