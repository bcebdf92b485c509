"""The split-device benchmark's code paths on a tiny run: gains, decisions, a split plan, outputs.

The gain part runs for real (small_cnn's stages, one and two cores, few
repetitions); the epoch part's plumbing (a profiled 2-stage plan, its split
variant trained by real workers and coordinator on loopback, samples/s from the
round metrics) runs without the testbed; the one-core quota experiment runs
when this process may make cgroup v1 cpu groups.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from common.store import Store
from services.planner.duanwu import BETA_RANGE
from tests.bench.async_runs import samples_per_s
from tests.bench.bench_duanwu_split import header_for
from tests.bench.duanwu_split_epoch import (
    EpochRow,
    cost_for,
    job_spec,
    measure_profile,
    pipeline_plan,
    plain_threads,
    plan_json,
    variants,
)
from tests.bench.duanwu_split_gain import (
    decide,
    gain_table,
    host_gains,
    planner_variant,
    stage_gains,
)
from tests.bench.duanwu_split_meet import (
    CPU_ROOT,
    LaneCgroups,
    Meeting,
    cpu_cgroup_writable,
    crossing,
    lane_core,
    run_meetings,
)
from tests.bench.duanwu_split_report import write_outputs
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
def test_the_one_core_experiment_measures_every_beta_and_the_pairs(meetings: list[Meeting]) -> None:
    # where the lanes cross is a timing figure: the bench reports it, the test checks the run
    (m,) = meetings
    assert m.forward_s > 0 and m.backward_s > 0
    assert 0 < m.optimal_beta < 1
    assert [p.beta for p in m.grid] == [0.2, 0.5, 0.8]
    assert all(p.forward_s > 0 and p.backward_s > 0 and p.pair_s > 0 for p in m.grid)
    assert m.at_optimal is not None and m.at_optimal.beta == m.optimal_beta
    assert (m.at_crossing is None) == (m.crossing_beta is None)


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
    assert set(runs) == {"plain", "split"}  # no planner plan: nothing more to run
    split, betas = runs["split"]
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

    # the gains on this machine and the planner's decisions from them
    gains = stage_gains("small_cnn", plan, TINY)
    cores = sorted(os.sched_getaffinity(0))
    host_gains(gains, repeats=2, cores=cores, registry=TINY)
    for g in gains:
        assert g.host_one is not None and g.host_one["cores"] == 1
        assert g.host_two is not None and g.host_two["cores"] == min(2, len(cores))
    decide(cost, plan, gains, "two cores")
    for g in gains:
        two = g.gain("two cores")
        assert (g.decisions["two cores"] == "split") == (two is not None and two > 0.02)
    # as if measured in the devices: a gain on "a" only, so only "a" splits
    gains[0].on_device = {**gains[0].host_two, "gain": 0.5}
    gains[1].on_device = {**gains[1].host_two, "gain": -0.1}
    decide(cost, plan, gains, "device")
    assert [g.decisions["device"] == "split" for g in gains] == [True, False]
    chosen, why = planner_variant(cost, plan, gains)
    assert why.startswith("gains allow a;")
    shares = [a.forward_share for s in chosen.stages for a in s.devices]
    split_chosen = why.endswith(": split")  # as the simulator scores the two plans
    assert shares == ([betas["a"], None] if split_chosen else [None, None])
    runs = variants(cost, plan, chosen)
    assert ("planner" in runs) == split_chosen
    if split_chosen:
        assert runs["planner"][1] == {"a": betas["a"]}
    for g in gains:
        g.on_device = {**g.on_device, "gain": 0.0}
    assert planner_variant(cost, plan, gains) == (
        plan,
        "no device's measured gain clears the margin: nothing split",
    )
    assert "variants" not in gain_table(gains)[0]

    # plain runs each device at the thread count its unsplit pair was fastest with
    # (and the gain is the split against that best unsplit way)
    for g in gains:
        m = g.host_two
        assert m is not None
        threads, one = m["in_turn_s"], m["in_turn_one_s"]
        assert m["best_threads"] == (1 if one < threads else m["cores"])
        assert m["gain"] == pytest.approx(min(threads, one) / m["split_s"] - 1)
    gains[0].on_device = {**gains[0].host_two, "best_threads": 1}
    gains[1].on_device = {**gains[1].host_two, "best_threads": 2}
    assert plain_threads(gains, cpu=0.5, cores=2) == {"a": 1, "b": 2}
    gains[1].on_device = None  # unmeasured: one thread where the quota is below the cores
    assert plain_threads(gains, cpu=0.5, cores=2) == {"a": 1, "b": 1}
    assert plain_threads(gains, cpu=2.0, cores=2) == {"a": 1, "b": 2}

    row = EpochRow("small_cnn", "split", betas, [(s.start, s.end) for s in split.stages])
    row.add(rate, rounds)
    assert row.samples_per_s == rate and row.runs == [rate]
    plain = EpochRow("small_cnn", "plain", None, row.stages, threads={"a": 1, "b": 2})
    plain.add(rate, rounds)
    meetings: list[Meeting] = []
    if cpu_cgroup_writable():
        meetings = request.getfixturevalue("meetings")
    out = tmp_path / "out"
    write_outputs(out, meetings, gains, [plain, row], header_for("smoke"))
    text = (out / "table.md").read_text()
    assert "## 2. Epoch time" in text and "+0.0 %" in text  # the same rate twice
    assert "| small_cnn | [0," in text and "| plain | 1 2 |" in text
    assert "## 1. The split's measured gain" in text and "**split**" in text
    assert (out / "gain.png").stat().st_size > 0
    assert (out / "epoch.png").stat().st_size > 0
    assert (out / "results.json").stat().st_size > 0
    if meetings:
        assert (out / "meet.png").stat().st_size > 0
