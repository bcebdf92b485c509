import os
from pathlib import Path

import pytest

from common.device import (
    cgroup_memory_limit,
    cpu_quota,
    default_threads,
    device_fingerprint,
    memory_budget,
    resident_bytes,
    training_budget,
)

GiB = 1 << 30
MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def bare(tmp_path):
    """A fake root with /proc but no cgroup limits."""
    _write(tmp_path, "proc/meminfo", MEMINFO)
    _write(tmp_path, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Fake CPU @ 1.0GHz\n")
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    return tmp_path


def test_memory_budget_without_cgroup_limit_is_available_memory(bare):
    assert cgroup_memory_limit(bare) is None
    assert memory_budget(0, bare) == 8000000 * 1024
    assert memory_budget(3 * GiB, bare) == 3 * GiB  # configured wins


def test_memory_budget_from_cgroup_v2(bare):
    _write(bare, "proc/self/cgroup", "0::/box/job\n")
    _write(bare, "sys/fs/cgroup/box/job/memory.max", "max\n")
    _write(bare, "sys/fs/cgroup/box/memory.max", f"{2 * GiB}\n")  # the parent's binds too
    assert memory_budget(0, bare) == 2 * GiB


def test_memory_budget_from_cgroup_v1(bare):
    _write(bare, "proc/self/cgroup", "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(bare, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{GiB}\n")
    _write(bare, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_memory_limit(bare) == GiB
    assert memory_budget(0, bare) == GiB


def test_memory_budget_in_a_container_sees_its_cgroup_at_the_root(bare):
    _write(bare, "proc/self/cgroup", "4:memory:/host/path/not/mounted\n")
    _write(bare, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{GiB}\n")
    assert memory_budget(0, bare) == GiB


def test_cpu_quota_v1_and_v2(bare):
    assert cpu_quota(bare) is None
    _write(bare, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(bare, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(bare) is None
    _write(bare, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "150000\n")
    assert cpu_quota(bare) == 1.5
    _write(bare, "sys/fs/cgroup/cpu.max", "50000 100000\n")
    assert cpu_quota(bare) == 0.5  # the tightest quota wins
    assert default_threads(bare) == 1


def test_fingerprint_is_stable_and_sensitive_to_threads_and_memory(bare):
    a = device_fingerprint(2, 0, bare)
    assert a == device_fingerprint(2, 0, bare)
    assert a != device_fingerprint(1, 0, bare)
    assert a != device_fingerprint(2, 4 * GiB, bare)
    # free memory changes all the time; the fingerprint does not follow it
    _write(bare, "proc/meminfo", MEMINFO.replace("8000000", "7000000"))
    assert a == device_fingerprint(2, 0, bare)


def test_fingerprint_tells_an_emulated_half_cpu_device_apart(bare):
    full = device_fingerprint(1, 0, bare)
    _write(bare, "sys/fs/cgroup/cpu.max", "50000 100000\n")
    half = device_fingerprint(1, 0, bare)
    assert half != full
    assert "-q0.5-" in half


def test_fingerprint_tells_cpu_models_apart(bare):
    a = device_fingerprint(1, 0, bare)
    _write(bare, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Other CPU\n")
    assert device_fingerprint(1, 0, bare) != a


def test_fingerprint_of_this_machine_has_no_key_separators():
    fp = device_fingerprint(1)
    assert fp == device_fingerprint(1)
    assert ":" not in fp and " " not in fp


def test_training_budget_leaves_out_what_the_process_already_holds(bare):
    pages = 300 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    _write(bare, "proc/self/statm", f"999999 {pages} 0 0 0 0 0\n")
    assert resident_bytes(bare) == 300 << 20
    assert training_budget(0, bare) == 8000000 * 1024  # no cgroup: MemAvailable
    _write(bare, "proc/self/cgroup", "4:memory:/bed/dev\n")
    _write(bare, "sys/fs/cgroup/memory/bed/dev/memory.limit_in_bytes", f"{GiB}\n")
    assert training_budget(0, bare) == GiB - (300 << 20)
    assert training_budget(123, bare) == 123  # configured wins
