"""Running a model's code: a separate Python process in a sandbox, bounded in every resource.

What holds, whichever way the sandbox is made:
- limits on CPU time, address space, file size, open files and processes (`setrlimit`), a
  wall-clock timeout after which the process and everything it started is killed (also when
  clbench itself dies), and output cut at :attr:`Limits.output_bytes`;
- a fresh temporary folder, removed afterwards; the program reads its input on stdin;
- when clbench runs as root, the code runs as an unprivileged user of its own, one per sandbox
  running at once (for root the kernel enforces no process limit, and sandboxes sharing a user
  would share one).

With **bubblewrap** (`bwrap`, Debian's `bubblewrap`) the process also gets its own network
(none), process, IPC and user namespaces and a filesystem that is read-only system folders and
interpreter, and a 16 MiB working folder in memory, the only place it can write; when it ends or
is killed, every process it started ends with it. Without bubblewrap (or where it cannot make
namespaces) the **rlimits** fallback applies the limits alone: the code can read what the user
can, write where the user can, signal the user's processes and open sockets. :func:`sandbox_kind`
says which is in use (a run records it), and the fallback is announced once per process.
"""

from __future__ import annotations

import json
import logging
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

from clbench.errors import UserError

log = logging.getLogger(__name__)

#: Under root, sandbox number i runs as user SANDBOX_UID + i (users with no account: nothing on
#: the machine belongs to them).
SANDBOX_UID = 1_900_000_000
#: The working folder's size under bubblewrap (it lives in memory).
WORKSPACE_BYTES = 16 << 20


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0           # then it is killed, with everything it started
    cpu_s: int = 5                 # CPU seconds per process
    memory_bytes: int = 512 << 20  # address space per process
    file_bytes: int = 1 << 20      # the largest file it may write
    processes: int = 8             # processes and threads, beyond those running already
    open_files: int = 64
    output_bytes: int = 256 << 10  # stdout and stderr kept, each


@dataclass(frozen=True)
class Outcome:
    """How a sandboxed run ended: its exit status (128 + N when killed by signal N; None when
    stopped at the wall-clock limit), what it wrote (cut at the limit), whether time ran out."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


class SandboxUnavailable(UserError):
    """No interpreter can run in the sandbox (neither in bubblewrap nor with rlimits)."""


def run_python(script: str, stdin: str = "", limits: Limits = Limits()) -> Outcome:
    """Run `python -I -S` on the program `script`, sandboxed, with `stdin` as its input."""
    kind, python = _setup()
    with _slot() as slot:
        return _run(kind, python, script, stdin, limits, slot)


def sandbox_kind() -> str:
    """`bubblewrap` or `rlimits`: how code is sandboxed on this machine."""
    return _setup()[0]


@lru_cache(maxsize=1)
def _setup() -> tuple[str, str]:
    """(kind, interpreter): the first of bubblewrap then rlimits under which one of the
    candidate interpreters runs a probe; found once per process."""
    probe = "import json, math, sys\nprint(json.dumps(math.factorial(int(sys.stdin.read()))))\n"
    kinds = (["bubblewrap"] if shutil.which("bwrap") else []) + ["rlimits"]
    for kind in kinds:
        for python in _interpreters():
            try:
                with _slot() as slot:
                    outcome = _run(kind, python, probe, "5", Limits(wall_s=20), slot)
            except OSError:
                continue
            if outcome.returncode == 0 and outcome.stdout.strip() == "120":
                if kind == "rlimits":
                    log.warning("code runs without bubblewrap, under resource limits alone: it "
                                "can read and write what %s can, signal its processes and use "
                                "the network (install Debian's bubblewrap)",
                                "this user" if os.geteuid() else "its user")
                return kind, python
    raise SandboxUnavailable(
        "no Python interpreter runs in the code sandbox (tried bubblewrap and plain resource "
        f"limits with {', '.join(_interpreters())}); as root, code runs as an unprivileged "
        "user, which must be able to read the interpreter (/usr/bin/python3 can be read by all)")


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


_free_slots: list[int] = []
_slots_lock = threading.Lock()
_next_slot = [0]


class _slot:
    """A sandbox number held while a sandbox runs (each number its own user under root)."""

    def __enter__(self) -> int:
        with _slots_lock:
            if _free_slots:
                self.number = _free_slots.pop()
            else:
                self.number = _next_slot[0]
                _next_slot[0] += 1
        return self.number

    def __exit__(self, *exc: object) -> None:
        with _slots_lock:
            _free_slots.append(self.number)


def _run(kind: str, python: str, script: str, stdin: str, limits: Limits, slot: int
         ) -> Outcome:
    user = SANDBOX_UID + slot if os.geteuid() == 0 else None
    folder = Path(tempfile.mkdtemp(prefix="clbench-sandbox-"))
    try:
        (folder / "main.py").write_text(script, encoding="utf-8")
        if user is not None:  # the fallback works in this folder, as the sandbox's user
            os.chown(folder, user, user)
        if kind == "bubblewrap":
            command = _bwrap_command(python, folder) + [python, "-I", "-S", "/inputs/main.py"]
        else:
            command = [python, "-I", "-S", str(folder / "main.py")]
        # out of the folder the code may write, so it cannot swap them for a FIFO or a link
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            status = _launch_and_wait(command, folder, stdin, out, err, limits, user)
            return Outcome(status, _read_cut(out, limits.output_bytes),
                           _read_cut(err, limits.output_bytes), status is None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _bwrap_command(python: str, folder: Path) -> list[str]:
    """bubblewrap around the interpreter: no network, its own namespaces, the system and its
    input read-only, a working folder in memory the only place it writes."""
    command = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent",
               "--new-session", "--ro-bind", "/usr", "/usr"]
    for system in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        command += ["--ro-bind-try", system, system]
    prefix = str(Path(python).parent.parent)
    if not prefix.startswith("/usr"):  # an interpreter outside /usr: its installation
        command += ["--ro-bind", prefix, prefix]
    return command + ["--proc", "/proc", "--dev", "/dev", "--ro-bind", str(folder), "/inputs",
                      "--size", str(WORKSPACE_BYTES), "--tmpfs", "/sandbox",
                      "--size", str(WORKSPACE_BYTES), "--tmpfs", "/tmp", "--chdir", "/sandbox",
                      "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                      "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8"]


def _environment(folder: Path) -> dict[str, str]:
    """The sandbox's environment (bubblewrap clears it and sets its own inside)."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(folder), "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


#: Run by this interpreter between clbench and the sandbox (`preexec_fn` is not safe while
#: other threads run, and graders run in threads). It dies with clbench (a parent-death
#: signal) and by its own deadline; forks the sandbox into its own session with the limits
#: (under root as the sandbox's user); adopts whatever the sandbox orphans (a child subreaper)
#: and, once the sandbox has ended or been stopped (SIGTERM, or the deadline), kills and reaps
#: every process left: none outlives it, and no zombie counts against a process limit.
_LAUNCHER = """
import ctypes, json, os, resource, signal, sys, time
spec = json.loads(sys.argv[1])
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with clbench
except (OSError, AttributeError):
    libc = None
if os.getppid() != spec["parent"]:
    os._exit(125)
class Stop(Exception):
    pass

def stop(*_):
    raise Stop

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGALRM, stop)
signal.alarm(spec["deadline"])
child = os.fork()
if child == 0:
    os.setsid()
    for name, value in spec["limits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    if spec["user"] is not None:
        os.setgroups([])
        os.setgid(spec["user"])
        os.setuid(spec["user"])
    if libc is not None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])

def children():
    found = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return found

stopped = False
try:
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # ended, not reaped
except Stop:
    stopped = True
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.alarm(0)
try:
    os.killpg(child, signal.SIGKILL)  # the child is not reaped yet: its group is its own
except OSError:
    pass
_, status = os.waitpid(child, 0)
end = time.monotonic() + 5
while time.monotonic() < end:
    for pid in children():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.01)
if stopped:
    os._exit(124)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


def _launch_and_wait(command: list[str], folder: Path, stdin: str, out: IO[bytes],
                     err: IO[bytes], limits: Limits, user: int | None) -> int | None:
    """Start `command` through the launcher under the limits, feed it `stdin`, wait up to the
    wall-clock limit, then stop it: the sandbox and everything it started. Its exit status, or
    None when time ran out."""
    # A process limit counts every process of the user: under root the sandbox's user has
    # none but the sandbox's; otherwise the user's own and its other sandboxes' are counted in.
    processes = limits.processes if user is not None else \
        _processes_of(os.getuid()) + limits.processes * max(2, os.cpu_count() or 1)
    spec = {"argv": command, "env": _environment(folder), "user": user,
            "parent": os.getpid(), "deadline": int(limits.wall_s) + 10,
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
        if status == 124:  # its own deadline (clbench was held up past the wall-clock limit)
            status = None
    except subprocess.TimeoutExpired:
        status = None
        process.terminate()  # the launcher kills the sandbox and what it started, and reaps
        try:
            process.wait(timeout=10)
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


def _read_cut(handle: IO[bytes], limit: int) -> str:
    handle.seek(0)
    return handle.read(limit).decode("utf-8", "replace")
