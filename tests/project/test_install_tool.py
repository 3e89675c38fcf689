"""`make setup`'s installer (tools/install.py): pip's configuration given to uv with pip's
precedence, and pip used where uv could not be told a setting or an argument."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from where import REPO

_SPEC = importlib.util.spec_from_file_location("install_tool", REPO / "tools" / "install.py")
assert _SPEC is not None and _SPEC.loader is not None
install = importlib.util.module_from_spec(_SPEC)
sys.modules["install_tool"] = install  # a dataclass looks its module up there
_SPEC.loader.exec_module(install)

# What `pip config list` prints on a machine with local wheels, a mirror and a constraints file
# (one in the files' [global], one in [install], the wheels also in a PIP_* variable).
LISTING = """\
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/more/simple'
global.find-links='/srv/old-wheels'
global.index-url='https://mirror.example/simple'
install.index-url='https://install-mirror.example/simple'
freeze.all='1'
"""


def test_pip_settings_take_pips_precedence() -> None:
    settings = install.pip_settings(LISTING)
    assert settings["find-links"] == "/opt/wheels"  # the variable over the file
    # [install] over [global]
    assert settings["index-url"] == "https://install-mirror.example/simple"
    assert settings["constraint"] == "/etc/pip/constraints.txt"
    assert "all" not in settings  # another command's section


def test_uv_is_given_every_setting_that_chooses_packages() -> None:
    command = install.uv_command(install.pip_settings(LISTING), ["-e", ".[test]"])
    assert command.unsupported == []
    pairs = list(zip(command.options[::2], command.options[1::2], strict=True))
    assert sorted(pairs) == [
        ("--constraints", "/etc/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/more/simple"),
        ("--extra-index-url", "file:///opt/pypi/simple"),
        ("--find-links", "/opt/wheels"),
        ("--index-strategy", "unsafe-best-match"),  # pip's: the best match over all indexes
        ("--index-url", "https://install-mirror.example/simple"),
    ]
    assert command.environment == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt"}


def test_an_index_on_the_command_line_replaces_the_configured_one() -> None:
    arguments = ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    command = install.uv_command(install.pip_settings(LISTING), arguments)
    assert "https://install-mirror.example/simple" not in command.options
    assert command.unsupported == []


def test_what_uv_cannot_be_told_leaves_the_install_to_pip() -> None:
    listing = "global.proxy='http://proxy.example:3128'\nglobal.no-index='yes'\n"
    command = install.uv_command(install.pip_settings(listing),
                                 ["--no-deps", "--pre", "pkg", "--target=/tmp/x"])
    assert command.unsupported == ["pip setting 'proxy'", "argument '--pre'",
                                   "argument '--target'"]
    assert "--no-index" in command.options


def test_a_value_after_an_argument_is_not_read_as_an_argument() -> None:
    command = install.uv_command({}, ["-e", "-weird-path", "--index-url=https://x.example"])
    assert command.unsupported == []


def test_pip_installs_when_uv_is_not_given_a_setting(tmp_path) -> None:
    """End to end through pip: a setting uv is not told about makes the tool say so and run
    pip, whose own error (a missing wheel folder with no index) comes back as the exit code."""
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nno-index = true\nfind-links = " + str(tmp_path / "none")
                      + "\nproxy = http://127.0.0.1:9\n")
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "install.py"), "-q", "no-such-package-clbench"],
        capture_output=True, text=True, timeout=120, check=False,
        env={"PIP_CONFIG_FILE": str(config), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    # the machine's own pip configuration may add settings of its own to the reasons
    assert done.stdout.startswith("installing with pip: uv is not given ")
    assert "pip setting 'proxy'" in done.stdout
    assert done.returncode != 0
    assert "no-such-package-clbench" in done.stderr
