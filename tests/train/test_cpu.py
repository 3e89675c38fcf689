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

