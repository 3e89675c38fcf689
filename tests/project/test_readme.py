"""The README's tour of the code names every module of `clbench/`, and only paths that exist."""

from __future__ import annotations

import re

from where import REPO

ROOT = REPO


def _tour() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text[text.index("## A tour"):text.index("## Writing a plugin")]


def test_the_tour_names_every_module_and_package_of_clbench() -> None:
    tour = _tour()
    package = ROOT / "clbench"
    expected = [f"clbench/{p.name}" for p in sorted(package.glob("*.py"))
                if p.name != "__init__.py"]
    expected += [f"clbench/{p.name}/" for p in sorted(package.iterdir())
                 if p.is_dir() and not p.name.startswith(("_", "."))]
    missing = [path for path in expected if f"`{path}`" not in tour]
    assert not missing, f"README tour lacks {missing}"


def test_every_path_in_the_tour_exists() -> None:
    paths = re.findall(r"`((?:clbench|methods|suites|benchmarks|docs)/[^`]*)`", _tour())
    assert paths
    assert not [p for p in paths if not (ROOT / p).exists()]
