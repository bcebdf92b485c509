"""The split-device benchmark's code paths on a tiny run: quota-split lanes, a split plan, outputs.

Part 1 runs for real (one small layer range, three betas, few repetitions) when
this process may make cgroup v1 cpu groups; part 2's plumbing (a profiled
2-stage plan, its optimal-beta variant trained by real workers and coordinator
on loopback, samples/s from the round metrics) runs without the testbed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from common.store import Store
from services.planner.duanwu import BETA_RANGE
from tests.bench.bench_duanwu_split import (
    CPU_ROOT,
    EpochRow,
    LaneCgroups,
    Meeting,
    cost_for,
    cpu_cgroup_writable,
    crossing,
    header_for,
    job_spec,
    lane_core,
    measure_profile,
    pipeline_plan,
    plan_json,
    run_meetings,
    samples_per_s,
    variants,
    write_outputs,
)
from tests.cluster import LocalCluster

TINY: dict[str, dict[str, Any]] = {"small_cnn": {"spec": {"name": "small_cnn"}, "micro": 16}}
needs_cgroups = pytest.mark.skipif(
    not cpu_cgroup_writable(), reason="needs root and a writable cgroup v1 cpu controller"
)


def _ours() -> list[str]:
    return [p.name for p in CPU_ROOT.glob(f"duanwu-split-{os.getpid()}-*")]


def test_crossing_interpolates_the_sign_change() -> None:
    assert crossing([0.2, 0.4, 0.6], [5.0, 3.0, 1.0], [1.0, 2.0, 4.0]) == pytest.approx(
        0.4 + 0.2 * 1.0 / 4.0
    )
    assert crossing([0.2, 0.4], [1.0, 1.0], [2.0, 3.0]) is None


@pytest.fixture(scope="module")
def meetings() -> list[Meeting]:
    if not cpu_cgroup_writable():
        pytest.skip("needs root and a writable cgroup v1 cpu controller")
    got = run_meetings(
        ["small_cnn"], (0.2, 0.5, 0.8), reps=3, warmup=1, registry=TINY, core=lane_core()
    )
    assert _ours() == []  # every group made is gone
    return got


@needs_cgroups
def test_lanes_cross_between_zero_and_one_near_the_optimal_beta(meetings: list[Meeting]) -> None:
    (m,) = meetings
    assert m.forward_s > 0 and m.backward_s > 0
    assert 0 < m.optimal_beta < 1
    assert m.crossing_beta is not None and 0 < m.crossing_beta < 1, m
    assert abs(m.crossing_beta - m.optimal_beta) < 0.2
    # a lane's time shrinks with its share: the forward's falls, the backward's grows with beta
    assert m.grid[0].forward_s > m.grid[-1].forward_s
    assert m.grid[0].backward_s < m.grid[-1].backward_s
    assert m.at_crossing is not None and m.at_optimal is not None


@needs_cgroups
def test_cgroups_are_removed_also_on_error() -> None:
    tid: list[int] = []
    done = threading.Event()

    def park() -> None:
        tid.append(threading.get_native_id())
        done.wait(10)

    t = threading.Thread(target=park)
    t.start()
    try:
        while not tid:
            pass
        with pytest.raises(RuntimeError), LaneCgroups() as groups:
            groups.set_share("F", 0.3)
            groups.move("F", tid[0])
            assert str(tid[0]) in (groups.lanes["F"] / "tasks").read_text().split()
            raise RuntimeError("boom")
        assert not groups.base.exists()
        assert str(tid[0]) in (groups.parent / "tasks").read_text().split()
    finally:
        done.set()
        t.join()
    assert _ours() == []


def test_split_plan_trains_and_the_outputs_are_written(
    tmp_path: Path, redis_url: str, cluster_name: str, request: pytest.FixtureRequest
) -> None:
    devices = ["a", "b"]
    cost = cost_for(measure_profile("small_cnn", TINY), devices, cpu=1.0)
    plan = pipeline_plan(cost, micro=16, global_batch=64)
    assert [a.device for s in plan.stages for a in s.devices] == devices
    runs = variants(cost, plan)
    split, betas = runs["optimal"]
    assert betas is not None and set(betas) == set(devices)
    assert all(BETA_RANGE[0] <= b <= BETA_RANGE[1] for b in betas.values())
    assert [a.forward_share for s in split.stages for a in s.devices] == [betas[d] for d in devices]
    assert all(a.forward_share is None for s in runs["plain"][0].stages for a in s.devices)

    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    try:
        cluster.start_workers(devices)
        job = job_spec("small_cnn", 3, "eq", TINY)
        assert cluster.run(job, plan_json(split), timeout_s=50) == 0, cluster.log("coordinator")
        store = Store(redis_url, cluster_name)
        try:
            metrics = store.read("metrics", "eq")
        finally:
            store.close()
    finally:
        cluster.close()
    rate, rounds = samples_per_s(metrics, plan.global_batch)
    assert len(rounds) == 3 and rate is not None and rate > 0

    row = EpochRow("small_cnn", "optimal", betas, [(s.start, s.end) for s in split.stages])
    row.add(rate, rounds)
    assert row.samples_per_s == rate and row.runs == [rate]
    plain = EpochRow("small_cnn", "plain", None, row.stages)
    plain.add(rate, rounds)
    meetings: list[Meeting] = []
    if cpu_cgroup_writable():
        meetings = request.getfixturevalue("meetings")
    out = tmp_path / "out"
    write_outputs(out, meetings, [plain, row], header_for("smoke"))
    text = (out / "table.md").read_text()
    assert "## 2. Epoch time" in text and "+0.0 %" in text  # the same rate twice
    assert (out / "epoch.png").stat().st_size > 0
    assert (out / "results.json").stat().st_size > 0
    if meetings:
        assert (out / "meet.png").stat().st_size > 0
