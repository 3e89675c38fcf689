"""The CPU cores a run may use, and torch's thread count chosen from them.

torch sizes its thread pool from the machine's cores, not from what this process may use: in a
container limited to 2 CPUs of a 64-core host it starts 64 threads, and N runs (a sweep, or the
N processes of a CPU launch) that each take every core slow each other down several times. A run
on the CPU therefore uses its share (`Distributed.take_cpu_share`): the cores in its affinity
mask, capped by a cgroup CPU quota, divided among the processes of its node. `OMP_NUM_THREADS`
(a sweep sets it for each of its children) is the user's choice and wins.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

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


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`); False where
    there is no glibc. A stage frees its optimizer state and the diagnostics their transient
    copies, in blocks of a few megabytes that glibc keeps in its heap: without this the next
    stage's allocations land beside them and the process's resident memory climbs stage after
    stage (docs/performance.md measures it)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    trim(0)
    return True
