"""The CPU cores a run may use, and torch's thread count chosen from them.

torch sizes its thread pool from the machine's cores, not from what this process may use: in a
container limited to 2 CPUs of a 64-core host it starts 64 threads, and N runs (a sweep, or the
N processes of a CPU launch) that each take every core slow each other down several times. A run
on the CPU therefore uses its share (`Distributed.take_cpu_share`): the cores in its affinity
mask, capped by a cgroup CPU quota, divided among the processes of its node. `OMP_NUM_THREADS`
(a sweep sets it for each of its children) is the user's choice and wins.

It also says which C allocator serves the process (:func:`allocator`): on a 2-core virtual
machine the starter took 10:27 under jemalloc (with :func:`keep_freed_pages`) against 12:40
under glibc's malloc (docs/performance.md, "The allocator"), so a CPU run records it and, under
glibc, says how to preload jemalloc.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

#: cgroup v2's CPU limit: "<quota> <period>" in microseconds, or "max <period>" (none).
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask (else every core of the machine),
    capped by a cgroup v2 CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_cpu_quota(path: Path = CGROUP_CPU_MAX) -> int | None:
    """The cgroup's CPU quota in whole cores, None without one."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def run_threads(processes_on_node: int = 1) -> int | None:
    """Threads for one of `processes_on_node` CPU processes: an equal share of the available
    cores; None when the user set `OMP_NUM_THREADS`."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, available_cpus() // max(1, processes_on_node))


def use_cpu_share(processes_on_node: int = 1) -> int:
    """Set torch's thread count to this process's share (:func:`run_threads`); the count in
    force afterwards."""
    import torch

    threads = run_threads(processes_on_node)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


#: Allocators a user may preload (`LD_PRELOAD`), by a fragment of their library's file name.
PRELOADED_ALLOCATORS = {"libjemalloc": "jemalloc", "libtcmalloc": "tcmalloc",
                        "libmimalloc": "mimalloc"}

#: Where a system's jemalloc usually lives (Debian/Ubuntu, Fedora, Arch, a local build).
JEMALLOC_PATHS = tuple(Path(p) for p in (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2"))


def allocator(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The C allocator this process's `malloc` comes from: a preloaded one by its library
    mapped into the process, else `glibc` where the C library is glibc; None where neither
    can be told (not Linux)."""
    try:
        mapped = maps.read_text()
    except OSError:
        return None
    for fragment, name in PRELOADED_ALLOCATORS.items():
        if f"/{fragment}" in mapped:
            return name
    return "glibc" if "/libc.so.6" in mapped or "/libc-2." in mapped else None


@functools.cache
def process_allocator() -> str | None:
    """:func:`allocator` of this process (it cannot change once the process runs)."""
    return allocator()


def system_jemalloc(paths: tuple[Path, ...] = JEMALLOC_PATHS) -> Path | None:
    """The system's jemalloc library, where it is installed in a usual place."""
    return next((p for p in paths if p.is_file()), None)


def allocator_hint(paths: tuple[Path, ...] = JEMALLOC_PATHS) -> str | None:
    """What to tell a CPU run served by glibc's malloc: how to start it under jemalloc (None
    under another allocator, or where the allocator is unknown)."""
    if process_allocator() != "glibc":
        return None
    found = system_jemalloc(paths)
    start = f"LD_PRELOAD={found} clbench run ..." if found is not None else \
        "install jemalloc (Debian/Ubuntu: apt-get install libjemalloc2) and preload it"
    return ("this CPU run uses glibc's malloc; the starter ran about a sixth shorter under "
            f"jemalloc where measured: {start} (`make run` does; docs/performance.md, "
            "\"The allocator\")")


@functools.cache
def _jemalloc_control() -> Any | None:
    """jemalloc's `mallctl` where it serves this process's malloc (preloaded), else None."""
    import ctypes

    try:
        control = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    control.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                        ctypes.c_void_p, ctypes.c_size_t]
    control.restype = ctypes.c_int
    return control


#: `arena.<i>.*` of every arena at once (jemalloc's MALLCTL_ARENAS_ALL).
_ALL_ARENAS = 4096


def keep_freed_pages() -> bool:
    """Under jemalloc, unless the user configured it (`MALLOC_CONF`): keep freed pages until
    :func:`release_free_memory` returns them, instead of jemalloc's time-based decay. Its
    default hands back every freed block of 8 MiB or more at once (a separate arena that purges
    eagerly) and other bursts soon after, so the next step's tensors of the same size take a
    page fault on every page: 61-64 million faults and 2:12-2:21 of system time in a starter
    run, against 19 million and 1:00 with this (docs/performance.md, "The allocator"). True
    when set."""
    import ctypes

    if os.environ.get("MALLOC_CONF") or process_allocator() != "jemalloc":
        return False
    control = _jemalloc_control()
    if control is None:
        return False
    never = ctypes.c_ssize_t(-1)
    size = ctypes.sizeof(never)
    # the default of arenas made later (the large blocks' arena among them), then those made
    if control(b"arenas.dirty_decay_ms", None, None, ctypes.byref(never), size) != 0:
        return False
    count, count_size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
    control(b"arenas.narenas", ctypes.byref(count), ctypes.byref(count_size), None, 0)
    for arena in range(count.value):  # arenas not yet made answer an error: nothing to set
        control(f"arena.{arena}.dirty_decay_ms".encode(), None, None, ctypes.byref(never), size)
    return True


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system: glibc's `malloc_trim`, or jemalloc's
    purge of every arena where it is preloaded; False under another allocator. A stage frees
    its optimizer state and the diagnostics their transient copies, in blocks of a few
    megabytes that glibc keeps in its heap: without this the next stage's allocations land
    beside them and the process's resident memory climbs stage after stage (docs/performance.md
    measures it). Under jemalloc with :func:`keep_freed_pages` these calls (after each training
    step, evaluation column and stage) are the only times pages go back."""
    if process_allocator() == "jemalloc":
        control = _jemalloc_control()
        return control is not None and \
            control(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, 0) == 0
    trim = _glibc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _glibc_trim() -> Any | None:
    """glibc's `malloc_trim`, None without glibc (looked up once: `find_library` runs
    `ldconfig`, and the run releases memory after every step and column)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


if __name__ == "__main__":  # `python -m clbench.train.cpu`: the system's jemalloc, for `make run`
    print(system_jemalloc() or "")
