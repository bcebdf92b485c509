"""Cgroup bookkeeping on fake v1 and v2 trees: which files get which values."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testbed.cgroups import (
    PARENT,
    CgroupError,
    DeviceCgroup,
    cpu_period_quota,
    find_testbed_groups,
    hierarchies,
)

MiB = 1 << 20


def v1_root(tmp_path: Path) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(
        "6:freezer:/\n4:memory:/jail/42\n2:cpuacct:/\n1:cpu:/\n0::/\n"
    )
    for d in ("cpu", "cpuacct", "memory/jail/42", "freezer", "unified"):
        (tmp_path / "sys/fs/cgroup" / d).mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/unified/cgroup.controllers").write_text("hugetlb\n")
    return tmp_path


def v2_root(tmp_path: Path) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/user.slice/me\n")
    (tmp_path / "sys/fs/cgroup/user.slice/me").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return tmp_path


def test_quota_uses_a_short_period_and_the_kernel_minimum():
    assert cpu_period_quota(0.5) == (10_000, 5_000)
    assert cpu_period_quota(0.13) == (10_000, 1_300)
    assert cpu_period_quota(0.05) == (100_000, 5_000)
    assert cpu_period_quota(0.001) == (100_000, 1_000)
    with pytest.raises(CgroupError):
        cpu_period_quota(0)


def test_v1_wins_on_hybrid_hosts_and_nests_below_our_own_group(tmp_path):
    root = v1_root(tmp_path)
    h = hierarchies(root)
    assert {c: x.version for c, x in h.items()} == {"cpu": 1, "memory": 1, "freezer": 1}
    assert h["memory"].own == root / "sys/fs/cgroup/memory/jail/42"
    cg = DeviceCgroup("t1", "nano-0", root)
    cg.create(0.3, 512 * MiB)
    mem = root / "sys/fs/cgroup/memory/jail/42" / PARENT / "t1/nano-0"
    cpu = root / "sys/fs/cgroup/cpu" / PARENT / "t1/nano-0"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "3000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "10000"
    for role in ("worker", "profiler"):
        assert (mem / role / "memory.limit_in_bytes").read_text() == str(512 * MiB)
    assert cg.cpu() == pytest.approx(0.3)
    assert cg.memory_limit() == 512 * MiB
    assert cg.procs_files("worker") == sorted(
        [
            cpu / "worker/cgroup.procs",
            mem / "worker/cgroup.procs",
            root / "sys/fs/cgroup/freezer" / PARENT / "t1/nano-0/worker/cgroup.procs",
        ]
    )
    cg.freeze()
    assert (root / "sys/fs/cgroup/freezer" / PARENT / "t1/nano-0/freezer.state").read_text() == (
        "FROZEN"
    )
    assert cg.frozen()
    cg.thaw()
    assert not cg.frozen()
    (mem / "worker/memory.max_usage_in_bytes").write_text("123456\n")
    (mem / "worker/memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (mem / "profiler/memory.oom_control").write_text("oom_kill 1\n")
    assert cg.peak_memory() == 123456
    assert cg.oom_kills() == 3
    assert sorted(find_testbed_groups(root)) == sorted(
        [cpu.parent, mem.parent, root / "sys/fs/cgroup/freezer" / PARENT / "t1"]
    )


def test_v1_memsw_is_limited_too_so_swap_cannot_hide_an_oom(tmp_path):
    root = v1_root(tmp_path)
    cg = DeviceCgroup("t1", "a", root)
    leaf = root / "sys/fs/cgroup/memory/jail/42" / PARENT / "t1/a/worker"
    leaf.mkdir(parents=True)
    (leaf / "memory.memsw.limit_in_bytes").write_text("-1")
    cg.create(0.5, 400 * MiB)
    assert (leaf / "memory.memsw.limit_in_bytes").read_text() == str(400 * MiB)


def test_v1_period_changes_in_an_order_the_kernel_accepts(tmp_path):
    root = v1_root(tmp_path)
    cg = DeviceCgroup("t1", "a", root)
    cg.create(0.5, 400 * MiB)
    cg.set_cpu(0.05)  # period grows to 100 ms
    cpu = root / "sys/fs/cgroup/cpu" / PARENT / "t1/a"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "5000"
    assert cg.cpu() == pytest.approx(0.05)


def test_v2_uses_cpu_max_memory_max_no_swap_and_cgroup_freeze(tmp_path):
    root = v2_root(tmp_path)
    h = hierarchies(root)
    assert {x.version for x in h.values()} == {2}
    cg = DeviceCgroup("t2", "nx-0", root)
    cg.create(0.468, 1 << 30)
    base = root / "sys/fs/cgroup/user.slice/me"
    dev = base / PARENT / "t2/nx-0"
    assert (dev / "cpu.max").read_text() == "4680 10000"
    assert (dev / "worker/memory.max").read_text() == str(1 << 30)
    for group in (base, base / PARENT, base / PARENT / "t2", dev):
        assert (group / "cgroup.subtree_control").read_text() == "+cpu +memory"
    cg.freeze()
    assert (dev / "cgroup.freeze").read_text() == "1"
    (dev / "worker/memory.peak").write_text("999\n")
    (dev / "worker/memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert cg.peak_memory() == 999
    assert cg.oom_kills() == 1
    assert cg.cpu() == pytest.approx(0.468)


def test_v2_swap_is_turned_off_where_the_kernel_offers_it(tmp_path):
    root = v2_root(tmp_path)
    leaf = root / "sys/fs/cgroup/user.slice/me" / PARENT / "t2/a/worker"
    leaf.mkdir(parents=True)
    (leaf / "memory.swap.max").write_text("max")
    DeviceCgroup("t2", "a", root).create(0.2, 256 * MiB)
    assert (leaf / "memory.swap.max").read_text() == "0"


def test_missing_controller_is_a_clear_error(tmp_path):
    (tmp_path / "sys/fs/cgroup/cpu").mkdir(parents=True)
    with pytest.raises(CgroupError, match="memory controller"):
        hierarchies(tmp_path)
