"""A third-party method plugin, pip-installed from a throwaway distribution, shows up in clbench.

This is the whole plugin story end to end: a package that clbench has never heard of declares an
entry point in `clbench.methods`, `pip install` puts it on the path, and both the console script
and the in-process registry find it. The package is uninstalled afterwards whatever happens.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from clbench.plugins import registry

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"
description = "A throwaway clbench method plugin"

[project.entry-points."clbench.methods"]
{method} = "{module}:DemoMethod"

[tool.setuptools]
py-modules = ["{module}"]
"""

MODULE = '''\
"""A method that a third party ships."""
from clbench.train.api import Method, MethodConfig, StageReport
from pydantic import Field


class DemoConfig(MethodConfig):
    temperature: float = Field(default=0.7, gt=0, description="How adventurous to be.")


class DemoMethod(Method):
    name = "{method}"
    description = "Third-party demo: trains nothing, politely."
    Config = DemoConfig

    def train_stage(self, ctx):
        return StageReport()
'''


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=180, env=env, check=False)


def test_pip_installed_plugin_is_listed_and_loadable(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    dist, module, method = f"clbench-demo-plugin-{tag}", f"clbench_demo_plugin_{tag}", \
        f"demo-{tag}"
    src = tmp_path / "plugin"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, module=module,
                                                         method=method))
    (src / f"{module}.py").write_text(textwrap.dedent(MODULE.format(method=method)))

    installed = pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
                    str(src))
    assert installed.returncode == 0, installed.stderr
    try:
        script = Path(sys.executable).with_name("clbench")
        listing = subprocess.run([str(script), "list", "methods"], capture_output=True,
                                 text=True, timeout=120, check=False,
                                 env={**os.environ, "COLUMNS": "200"})
        assert listing.returncode == 0, listing.stderr
        row = next(line for line in listing.stdout.splitlines() if method in line)
        assert "Third-party demo: trains nothing, politely." in row
        assert dist in row

        importlib.invalidate_caches()
        registry.clear_cache()
        cls = registry.load_method_class(method)
        assert cls.__module__ == module
        assert cls.Config().temperature == 0.7
    finally:
        removed = pip("uninstall", "--yes", "--quiet", dist)
        registry.clear_cache()
        sys.modules.pop(module, None)
    assert removed.returncode == 0, removed.stderr
    assert method not in registry.plugin_names(registry.METHODS_GROUP)
