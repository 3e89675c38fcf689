"""A CPU run's thread count: the cores it may use (affinity, cgroup quota), shared among the
processes of its node, unless the user chose with OMP_NUM_THREADS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from clbench.train import cpu
from clbench.train.distributed import Distributed


@pytest.mark.parametrize(("content", "cores"), [
    ("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2),
    ("50000 100000\n", 1), ("garbage\n", None)])
def test_a_cgroup_quota_is_read_in_whole_cores(tmp_path: Path, content: str,
                                               cores: int | None) -> None:
    (tmp_path / "cpu.max").write_text(content)
    assert cpu.cgroup_cpu_quota(tmp_path / "cpu.max") == cores
    assert cpu.cgroup_cpu_quota(tmp_path / "absent") is None


def test_the_quota_caps_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(cpu, "cgroup_cpu_quota", lambda: 2)
    assert cpu.available_cpus() == 2
    monkeypatch.setattr(cpu, "cgroup_cpu_quota", lambda: None)
    assert cpu.available_cpus() == 64


def test_a_cpu_run_takes_its_share_of_the_cores_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "available_cpus", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu.run_threads() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert [cpu.run_threads(n) for n in (1, 2, 3, 8, 20)] == [8, 4, 2, 1, 1]
    saved = torch.get_num_threads()
    try:
        monkeypatch.setattr(cpu, "available_cpus", lambda: 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two CPU processes launched on this node
        dist = Distributed.create("cpu", "float32", mixed_precision=False)
        torch.set_num_threads(2)  # creating the accelerator leaves a script's choice alone
        assert torch.get_num_threads() == 2
        dist.take_cpu_share()  # a run takes its share
        assert torch.get_num_threads() == 1
        assert dist.describe()["cpu_threads"] == 1
    finally:
        torch.set_num_threads(saved)


def test_free_heap_memory_goes_back_to_the_system() -> None:
    from clbench.train.cpu import release_free_memory

    def resident() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3
    # As glibc behaves once a process has freed large blocks (a stage's optimizer state): its
    # mmap threshold raised, blocks of a few hundred KB come from the heap, and its top is not
    # trimmed while other blocks live above the freed ones (fixed here: the test is then the
    # same whatever ran before it in the process)
    assert libc.mallopt(m_mmap_threshold, 4 * 2**20) == 1
    assert libc.mallopt(m_trim_threshold, 2**30) == 1
    try:
        blocks = [torch.ones(1 << 17) for _ in range(400)]  # 400 x 512 KB
        pin = torch.ones(16)
        before = resident()
        del blocks
        freed = resident()
        assert freed > before - 50 * 2**20  # freed, but still resident: what a stage leaves
        assert release_free_memory()
        after = resident()
        assert freed - after > 150 * 2**20, (before, freed, after)  # most of the 200 MB back
        del pin
    finally:
        libc.mallopt(m_mmap_threshold, 128 * 1024)  # glibc's defaults
        libc.mallopt(m_trim_threshold, 128 * 1024)


def test_the_allocator_is_told_from_the_libraries_mapped_into_the_process(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    libc = ("7f2a1c000000-7f2a1c028000 r--p 00000000 fd:01 1234 "
            "/usr/lib/x86_64-linux-gnu/libc.so.6\n")
    jemalloc = ("7f2a1b000000-7f2a1b010000 r-xp 00000000 fd:01 99 "
                "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    arrow = "7f2a1a000000-7f2a1a100000 r-xp 00000000 fd:01 7 /venv/pyarrow/libarrow.so.1800\n"
    maps.write_text(libc + arrow)
    assert cpu.allocator(maps) == "glibc"  # pyarrow's own jemalloc inside libarrow is not malloc
    maps.write_text(jemalloc + libc)
    assert cpu.allocator(maps) == "jemalloc"
    maps.write_text("7f2a1a000000-7f2a1a100000 r-xp 00000000 fd:01 7 /usr/lib/libSystem.dylib\n")
    assert cpu.allocator(maps) is None
    assert cpu.allocator(tmp_path / "absent") is None
    assert cpu.allocator() in ("glibc", "jemalloc")  # this process, on Linux


def test_a_glibc_run_is_told_how_to_start_under_jemalloc(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    library = tmp_path / "libjemalloc.so.2"
    monkeypatch.setattr(cpu, "process_allocator", lambda: "glibc")
    assert "apt-get install libjemalloc2" in (cpu.allocator_hint((library,)) or "")
    library.write_bytes(b"")
    hint = cpu.allocator_hint((tmp_path / "absent.so", library))
    assert f"LD_PRELOAD={library} clbench run" in hint
    monkeypatch.setattr(cpu, "process_allocator", lambda: "jemalloc")
    assert cpu.allocator_hint((library,)) is None


def test_glibc_and_a_configured_jemalloc_are_left_as_they_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "process_allocator", lambda: "glibc")
    assert cpu.keep_freed_pages() is False
    monkeypatch.setattr(cpu, "process_allocator", lambda: "jemalloc")
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:5000")
    assert cpu.keep_freed_pages() is False  # the user's configuration wins


#: Allocates and frees 16 MiB tensors; prints the page faults they took and the resident memory
#: before and after `release_free_memory` once 400 MB are freed.
_JEMALLOC_PROBE = """
import json, resource, torch
from clbench.train.cpu import keep_freed_pages, process_allocator, release_free_memory
kept = keep_freed_pages()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
start = faults()
for _ in range(50):
    x = torch.empty(4 * 2**20)
    x.fill_(1.0)
    del x
churn = faults() - start
blocks = [torch.ones(2**18) for _ in range(400)]
del blocks
freed = resident()
released = release_free_memory()
print(json.dumps({"allocator": process_allocator(), "kept": kept, "churn": churn,
                  "freed": freed, "after": resident(), "released": released}))
"""


@pytest.mark.skipif(cpu.system_jemalloc() is None,
                    reason="needs the system's jemalloc (apt-get install libjemalloc2)")
def test_under_jemalloc_freed_pages_stay_until_the_run_releases_them() -> None:
    import json
    import subprocess
    import sys

    def probe(**env: str) -> dict:
        environment = {k: v for k, v in os.environ.items() if k != "MALLOC_CONF"}
        environment.update(LD_PRELOAD=str(cpu.system_jemalloc()), OMP_NUM_THREADS="1", **env)
        done = subprocess.run([sys.executable, "-c", _JEMALLOC_PROBE], env=environment,
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    kept = probe()
    assert kept["allocator"] == "jemalloc" and kept["kept"] and kept["released"]
    pages = 50 * 16 * 2**20 // 4096
    assert kept["churn"] < pages // 10, kept  # the same 16 MiB reused: faulted about once
    assert kept["freed"] - kept["after"] > 300 * 2**20, kept  # the 400 MB go back when released
    default = probe(MALLOC_CONF="background_thread:false")  # a user's configuration: untouched
    assert not default["kept"]
    assert default["churn"] > pages // 2, default  # jemalloc's default: a fault on every page
