"""What a wheel of clbench contains: every package of the source tree (setuptools' list is
explicit, so a new subpackage left out of it would be missing from an installed clbench)."""

from __future__ import annotations

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration  # reads TOML on Python 3.10 too

ROOT = Path(__file__).resolve().parent.parent


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
