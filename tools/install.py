"""`make setup`'s installer: `pip install` arguments, installed by uv where it can, else by pip.

    .venv/bin/python tools/install.py -e ".[test]"

installs into the environment of the Python that runs it. uv installs clbench's environment
several times faster than pip (docs/performance.md, "The whole starter run"), but it reads
neither pip's configuration files nor its `PIP_*` variables, so a machine set up for pip (a
mirror, local wheels, a constraints file) would get other packages from uv. The settings in
pip's configuration that choose what is installed are therefore passed on to uv as its own
options, with pip's precedence (`PIP_*` over a file's `[install]` over its `[global]`) and pip's
index semantics (the best match over all indexes). Where pip's configuration holds a setting uv
cannot be given, where an argument is not one uv is given here, or where uv cannot be had
(on the PATH, in the environment, or installed into it by pip), pip installs, as before; a uv
install that fails is retried with pip. Only the standard library: it runs before anything else
is installed.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# pip's settings that decide what gets installed, and uv's option for each.
_REPEATED = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraints", "trusted-host": "--allow-insecure-host"}
_SINGLE = {"index-url": "--index-url"}
_FLAGS = {"no-index": "--no-index"}
# pip's settings that uv takes from the environment.
_ENVIRONMENT = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT",
                "default-timeout": "UV_HTTP_TIMEOUT", "retries": "UV_HTTP_RETRIES"}
# pip's settings that change how pip talks or reports, not what it installs (`config-file`:
# where the settings read here came from).
_NO_EFFECT = {"config-file", "disable-pip-version-check", "no-input", "progress-bar",
              "root-user-action", "no-color", "quiet", "verbose", "no-python-version-warning",
              "require-virtualenv", "cache-dir", "no-cache-dir", "no-warn-script-location"}
# `pip install` arguments passed on to uv as they are: flags, and those a value follows.
_FLAG_ARGUMENTS = {"--no-deps", "-q", "--quiet"}
_WITH_VALUE = {"-e", "--editable", "--index-url", "-i", "--extra-index-url", "--find-links",
               "-f", "-c"}
_TRUE = {"1", "true", "yes", "on"}


@dataclass
class UvCommand:
    """What uv is given for one install; `unsupported` names why pip installs instead."""

    options: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)


def pip_settings(listing: str) -> dict[str, str]:
    """pip's effective install settings from `pip config list`: `PIP_*` variables over the
    files' `[install]` section over their `[global]` one (pip has merged the files already)."""
    layers: dict[str, dict[str, str]] = {"global": {}, "install": {}, ":env:": {}}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, dot, name = key.rpartition(".")
        if not sep or not dot or section not in layers:
            continue
        try:
            layers[section][name] = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            layers[section][name] = value
    return {**layers["global"], **layers["install"], **layers[":env:"]}


def uv_command(settings: dict[str, str], arguments: list[str]) -> UvCommand:
    """uv's options for pip's `settings` and the `pip install` `arguments` (an index named on
    the command line replaces the configured one, as with pip)."""
    command = UvCommand(options=["--index-strategy", "unsafe-best-match"])
    given = {argument.partition("=")[0] for argument in arguments if argument.startswith("-")}
    for name, value in settings.items():
        if name in _REPEATED:
            for item in value.split():
                command.options += [_REPEATED[name], item]
        elif name in _SINGLE:
            if not given & {"--index-url", "-i"}:
                command.options += [_SINGLE[name], value]
        elif name in _FLAGS:
            if value.lower() in _TRUE:
                command.options.append(_FLAGS[name])
        elif name in _ENVIRONMENT:
            command.environment[_ENVIRONMENT[name]] = value
        elif name not in _NO_EFFECT:
            command.unsupported.append(f"pip setting {name!r}")
    expects_value = False
    for argument in arguments:
        if expects_value:
            expects_value = False
            continue
        if not argument.startswith("-"):
            continue
        flag = argument.partition("=")[0]
        if flag not in _FLAG_ARGUMENTS | _WITH_VALUE:
            command.unsupported.append(f"argument {flag!r}")
        expects_value = flag in _WITH_VALUE and "=" not in argument
    return command


def _find_uv(python: str) -> str | None:
    """uv on the PATH or in the environment, else installed into it by pip (None if that
    fails)."""
    beside = Path(python).parent / "uv"
    found = shutil.which("uv") or (str(beside) if beside.is_file() else None)
    if found:
        return found
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "uv"], check=False)
    return str(beside) if installed.returncode == 0 and beside.is_file() else None


def _pip(python: str, arguments: list[str]) -> int:
    return subprocess.run([python, "-m", "pip", "install", *arguments], check=False).returncode


def main(arguments: list[str]) -> int:
    python = sys.executable
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, check=False)
    if listing.returncode != 0:  # without pip's settings uv would install from elsewhere
        print("installing with pip: `pip config list` failed", flush=True)
        return _pip(python, arguments)
    command = uv_command(pip_settings(listing.stdout), arguments)
    if command.unsupported:
        print(f"installing with pip: uv is not given {', '.join(command.unsupported)} here",
              flush=True)
        return _pip(python, arguments)
    uv = _find_uv(python)
    if uv is None:
        print("installing with pip: uv could not be had", flush=True)
        return _pip(python, arguments)
    environment = {**os.environ, **command.environment}
    done = subprocess.run([uv, "pip", "install", "--python", python, "--compile-bytecode",
                           *command.options, *arguments], env=environment, check=False)
    if done.returncode == 0:
        return 0
    print("uv's install failed; installing with pip", flush=True)
    return _pip(python, arguments)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
