"""Running a model's code: a separate Python process in a sandbox, bounded in every resource.

What holds, whichever way the sandbox is made:
- limits on CPU time, address space, file size, open files and processes (`setrlimit`), a
  wall-clock timeout after which the process and everything it started is killed, and output
  cut at :attr:`Limits.output_bytes`;
- a fresh temporary folder as the working folder, removed afterwards;
- when clbench runs as root, the code runs as `nobody` (for root, the kernel enforces no
  process limit).

With **bubblewrap** (`bwrap`, Debian's `bubblewrap`) the process also gets its own network
(none), process, IPC and user namespaces and a filesystem that is read-only system folders, the
interpreter, an empty `/tmp` and its own folder, the only place it can write; when the process
ends or is killed, every process it started ends with it. Without bubblewrap (or where it cannot
make namespaces) the **rlimits** fallback applies the limits alone: the code can read what the
user can, write where the user can and open sockets. :func:`sandbox_kind` says which is in use;
a run records it in its results.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO

#: The user unprivileged code runs as when clbench runs as root.
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0           # then it is killed, with everything it started
    cpu_s: int = 5                 # CPU seconds per process
    memory_bytes: int = 512 << 20  # address space per process
    file_bytes: int = 1 << 20      # the largest file it may write (its output included)
    processes: int = 8             # processes and threads, beyond those running already
    open_files: int = 64
    output_bytes: int = 64 << 10   # stdout and stderr kept, each


@dataclass(frozen=True)
class Outcome:
    """How a sandboxed run ended: its exit status (None when killed at the wall-clock limit),
    what it wrote (cut at the limit) and whether time ran out."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


class SandboxUnavailable(RuntimeError):
    """No interpreter can run in the sandbox (neither in bubblewrap nor with rlimits)."""


def run_python(files: dict[str, str], script: str, stdin: str = "",
               limits: Limits = Limits()) -> Outcome:
    """Write `files` into a fresh folder and run `python -I -S script` there, sandboxed."""
    kind, python = _setup()
    return _run(kind, python, files, script, stdin, limits)


def sandbox_kind() -> str:
    """`bubblewrap` or `rlimits`: how code is sandboxed on this machine."""
    return _setup()[0]


@lru_cache(maxsize=1)
def _setup() -> tuple[str, str]:
    """(kind, interpreter): the first of bubblewrap then rlimits under which one of the
    candidate interpreters runs a probe; found once per process."""
    probe = {"probe.py": "import json, math\nprint(json.dumps(math.factorial(5)))\n"}
    kinds = (["bubblewrap"] if shutil.which("bwrap") else []) + ["rlimits"]
    for kind in kinds:
        for python in _interpreters():
            try:
                outcome = _run(kind, python, probe, "probe.py", "", Limits(wall_s=20))
            except OSError:
                continue
            if outcome.returncode == 0 and outcome.stdout.strip() == "120":
                return kind, python
    raise SandboxUnavailable(
        "no Python interpreter runs in the code sandbox (tried bubblewrap and plain resource "
        f"limits with {', '.join(_interpreters())}); as root, code runs as user nobody, which "
        "must be able to read the interpreter")


def _interpreters() -> list[str]:
    """Interpreters to try: this one, its base, then the system's."""
    found: list[str] = []
    for candidate in (sys.executable, getattr(sys, "_base_executable", None),
                      "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.exists(candidate):
            real = os.path.realpath(candidate)
            if real not in found:
                found.append(real)
    return found


def _run(kind: str, python: str, files: dict[str, str], script: str, stdin: str,
         limits: Limits) -> Outcome:
    as_root = os.geteuid() == 0
    folder = Path(tempfile.mkdtemp(prefix="clbench-sandbox-"))
    try:
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
        if as_root:  # the code runs as nobody: its folder is the one it can write
            for path in [folder, *folder.iterdir()]:
                os.chown(path, NOBODY, NOBODY)
        command = _bwrap_command(python, folder) if kind == "bubblewrap" else [python]
        command += ["-I", "-S", script]
        out_path, err_path = folder / ".stdout", folder / ".stderr"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            status = _launch_and_wait(command, folder, stdin, out, err, limits, as_root)
        return Outcome(status, _read_cut(out_path, limits.output_bytes),
                       _read_cut(err_path, limits.output_bytes), status is None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: Run by this interpreter between clbench and the sandbox (`preexec_fn` is not safe while
#: other threads run, and graders run in threads). It forks the sandbox into its own session
#: with the limits (under root as nobody), and adopts whatever the sandbox orphans (a child
#: subreaper), so that every process it started is reaped: zombies would count against the
#: process limit. SIGTERM kills the sandbox's session; when the sandbox ends, what is left of
#: its session is killed too.
_LAUNCHER = """
import ctypes, json, os, resource, signal, sys, time
spec = json.loads(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
except (OSError, AttributeError):
    pass
child = os.fork()
if child == 0:
    os.setsid()
    for name, value in spec["limits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    if spec["user"] is not None:
        os.setgroups([])
        os.setgid(spec["user"])
        os.setuid(spec["user"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])

def stop(signum, frame):
    try:
        os.killpg(child, signal.SIGKILL)
    except OSError:
        pass

signal.signal(signal.SIGTERM, stop)
_, status = os.waitpid(child, 0)
stop(None, None)
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            time.sleep(0.01)
    except ChildProcessError:
        break
os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""


def _launch_and_wait(command: list[str], folder: Path, stdin: str, out: IO[bytes],
                     err: IO[bytes], limits: Limits, as_root: bool) -> int | None:
    """Start `command` through the launcher under the limits, feed it `stdin`, wait up to the
    wall-clock limit, then stop it: the sandbox and everything it started. Its exit status, or
    None when time ran out."""
    processes = limits.processes + (0 if as_root else _processes_of(os.getuid()))
    spec = {"argv": command, "env": _environment(folder), "user": NOBODY if as_root else None,
            "limits": [("RLIMIT_CPU", limits.cpu_s), ("RLIMIT_AS", limits.memory_bytes),
                       ("RLIMIT_FSIZE", limits.file_bytes),
                       ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_NPROC", processes),
                       ("RLIMIT_CORE", 0)]}
    process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)],
                               cwd=folder, stdin=subprocess.PIPE, stdout=out, stderr=err,
                               start_new_session=True, close_fds=True)
    feeder = threading.Thread(target=_feed, args=(process, stdin), daemon=True)
    feeder.start()
    try:
        status: int | None = process.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        status = None
        process.terminate()  # the launcher kills the sandbox's session and reaps it
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # not yet reaped: the id is still its own
            process.wait()
    feeder.join(timeout=1)
    return status


def _feed(process: subprocess.Popen, stdin: str) -> None:
    assert process.stdin is not None
    try:
        process.stdin.write(stdin.encode("utf-8", "replace"))
        process.stdin.close()
    except OSError:  # it exited or closed its input without reading
        pass


def _bwrap_command(python: str, folder: Path) -> list[str]:
    """bubblewrap around the interpreter: no network, its own namespaces, the system read-only,
    its folder (mounted at /sandbox) and an empty /tmp the only places it writes."""
    command = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent",
               "--new-session",
               "--ro-bind", "/usr", "/usr"]
    for system in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        command += ["--ro-bind-try", system, system]
    prefix = str(Path(python).parent.parent)
    if not prefix.startswith("/usr"):  # an interpreter outside /usr: its installation
        command += ["--ro-bind", prefix, prefix]
    return command + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                      "--bind", str(folder), "/sandbox", "--chdir", "/sandbox",
                      "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                      "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8", python]


def _environment(folder: Path) -> dict[str, str]:
    """The sandbox's environment (bubblewrap clears it and sets its own inside)."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(folder), "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


def _processes_of(uid: int) -> int:
    """How many processes (threads included) the user runs now: a process limit counts them
    all, so the sandbox's is on top of these."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def _read_cut(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        return f.read(limit).decode("utf-8", "replace")
