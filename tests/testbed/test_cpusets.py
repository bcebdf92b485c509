"""Cores of a device's own (cpuset): the files on fake trees, a real group, the spec field."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from services.testbed.cgroups import PARENT, DeviceCgroup, cpuset_hierarchy, find_testbed_groups
from services.testbed.spec import TestbedSpec, parse_cpus
from tests.testbed.test_cgroups import v1_root, v2_root
from tests.testbed.traces import traces

MiB = 1 << 20


def v1_with_cpuset(tmp_path: Path) -> Path:
    root = v1_root(tmp_path)
    mount = root / "sys/fs/cgroup/cpuset"
    mount.mkdir()
    (mount / "cpuset.cpus").write_text("0-3\n")
    (mount / "cpuset.mems").write_text("0\n")
    return root


def test_v1_levels_above_get_the_parents_cores_and_the_device_its_own(tmp_path):
    root = v1_with_cpuset(tmp_path)
    mount = root / "sys/fs/cgroup/cpuset"
    assert cpuset_hierarchy(root) is not None
    cg = DeviceCgroup("t1", "duo", root)
    cg.create(2.0, 512 * MiB, cpus="1-2")
    dev = mount / PARENT / "t1/duo"
    for level, want in [
        (mount / PARENT, "0-3"),
        (mount / PARENT / "t1", "0-3"),
        (dev, "1-2"),
        (dev / "worker", "1-2"),
        (dev / "profiler", "1-2"),
    ]:
        assert (level / "cpuset.cpus").read_text() == want
        assert (level / "cpuset.mems").read_text() == "0"
    assert cg.cpus() == "1-2"
    assert dev / "worker/cgroup.procs" in cg.procs_files("worker")
    assert mount / PARENT / "t1" in find_testbed_groups(root)


def test_a_device_without_cores_makes_no_cpuset_group(tmp_path):
    root = v1_with_cpuset(tmp_path)
    cg = DeviceCgroup("t1", "solo", root)
    cg.create(0.5, 512 * MiB)
    assert not (root / "sys/fs/cgroup/cpuset" / PARENT).exists()
    assert cg.cpus() is None
    assert all("cpuset" not in f.parts for f in cg.procs_files("worker"))


def test_v2_hands_the_cpuset_controller_down_and_sets_the_devices_cores(tmp_path):
    root = v2_root(tmp_path)
    cg = DeviceCgroup("t2", "duo", root)
    cg.create(2.0, 1 << 30, cpus="0-1")
    dev = root / "sys/fs/cgroup/user.slice/me" / PARENT / "t2/duo"
    assert (dev / "cpuset.cpus").read_text() == "0-1"
    assert (dev.parent / "cgroup.subtree_control").read_text() == "+cpuset"
    assert cg.cpus() == "0-1"


def test_the_spec_reads_kernel_cpu_lists_and_warns_about_what_the_machine_lacks():
    assert parse_cpus("0-1,4") == {0, 1, 4}
    with pytest.raises(ValueError, match="backwards"):
        parse_cpus("3-1")
    devices = [
        {"name": "a", "cpu": 2.0, "cpus": "0-1", "memory_bytes": "1GiB", "bandwidth_bps": 1e9},
        {"name": "b", "cpu": 3.0, "cpus": "0-1", "memory_bytes": "1GiB", "bandwidth_bps": 1e9},
        {"name": "c", "cpu": 0.5, "cpus": "5", "memory_bytes": "1GiB", "bandwidth_bps": 1e9},
    ]
    spec = TestbedSpec.model_validate({"name": "x", "subnet": "10.9.0.0/24", "devices": devices})
    assert spec.device("a").cores() == {0, 1}
    said = "\n".join(spec.warnings(cores=2))
    assert "device a " not in said
    assert "device b has a 3-core quota on 2 cores" in said
    assert "device c is given cores [5]" in said
    with pytest.raises(ValueError):
        TestbedSpec.model_validate(
            {"name": "x", "subnet": "10.9.0.0/24", "devices": [{**devices[0], "cpus": "0-"}]}
        )


@pytest.mark.integration
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_real_device_on_its_cores_pins_its_process_and_down_removes_the_group(testbed_host, tag):
    core = max(os.sched_getaffinity(0))
    cg = DeviceCgroup(tag, "duo")
    if cg.cpuset_h is None:
        pytest.skip("no cpuset controller on this machine")
    cg.create(1.0, 128 * MiB, roles=("worker",), cpus=str(core))
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        cg.attach(sleeper.pid)
        assert os.sched_getaffinity(sleeper.pid) == {core}
        assert cg.cpus() == str(core)
        assert sleeper.pid in cg.pids()
        cg.remove()
        assert sleeper.wait(timeout=10) == -9
        assert traces(tag) == []
    finally:
        sleeper.kill()
        sleeper.wait()
