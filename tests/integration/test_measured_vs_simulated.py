"""Measured against simulated, in CI: a short real run lands in a documented band.

A profile taken here, the Asteroid plan made from it for two workers on this
machine, and a few real rounds with that plan. The measured median round time
over the simulator's prediction must lie in [LOW, HIGH].

This machine is shared, and load during the profile or the rounds moved the
plain ratio anywhere in 0.6-3.3 over seven runs beside other test sessions, so
a band wide enough for that could not tell a simulator off by 2x. The load
is taken out by calibration: each device's profile is scaled by how much
slower its forwards and backwards ran in these rounds (the workers' own
timings) before simulating. What remains is what the simulator composes
(pipeline fill and drain, waiting, transfers, the all-reduce) plus the
per-round overhead it does not model (messages, the optimizer step), which
keeps the ratio a little above 1: 1.03-1.15 over five runs, one of them under
load that slowed compute 1.6x (uncalibrated 1.86 there). A simulator off by 2x in either direction
moves the ratio by that factor and leaves the band. The slow test below checks
the uncalibrated ratio, meaningful only on an otherwise idle machine
(`make test-slow`).
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch

from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from common.zoo import ModelSpec
from services.planner.cost import CostModel
from services.planner.registry import get_planner
from services.planner.simulator import simulate
from services.profiler.layers import profile_model
from tests.integration.test_equivalence import run_job

pytestmark = pytest.mark.integration

MODEL = {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}
ROUNDS = 6
WARM_UP = 2  # first rounds left out: allocator growth, first-touch pages
LOW, HIGH = 0.7, 1.6
DEVICES = ("w0", "w1")


def _cluster(slowdown: dict[str, float]) -> ClusterSpec:
    return ClusterSpec(
        devices=[
            DeviceSpec(name=n, memory_bytes=2 << 30, profile="here", slowdown=slowdown[n])
            for n in DEVICES
        ],
        bandwidth=1e9,  # loopback
    )


def _profile_here(sizes: list[int]) -> Profile:
    """MODEL's profile on this machine, one thread as each worker runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_model(
            ModelSpec.model_validate(MODEL), sizes, repeats=3, warmup=1, memory_budget=2 << 30
        )
    finally:
        torch.set_num_threads(threads)


def _train(tmp_path, redis_url, cluster_name, plan: Plan, rounds: int) -> list[dict[str, Any]]:
    """Run `plan` for `rounds` real rounds; the metrics of each committed round."""
    _, _, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        MODEL,
        [s.model_dump(mode="json") for s in plan.stages],
        rounds=rounds,
        m=plan.microbatches,
        batch=plan.global_batch,
        optimizer={"kind": "sgd", "lr": 0.01, "momentum": 0.9},
    )
    return [m for m in metrics if "round_s" in m]


def test_short_run_measures_what_the_simulator_predicts(tmp_path, redis_url, cluster_name):
    prof = _profile_here([1, 2, 4, 8])
    cost = CostModel({"here": prof}, _cluster(dict.fromkeys(DEVICES, 1.0)))
    plan = get_planner("asteroid").plan(cost, 32, 4)
    metrics = _train(tmp_path, redis_url, cluster_name, plan, ROUNDS)
    steady = metrics[WARM_UP:]
    assert len(steady) == ROUNDS - WARM_UP
    measured = statistics.median(m["round_s"] for m in steady)
    # calibration: measured compute of each device over what its profile predicts
    slowdown = {}
    for s, spec in enumerate(plan.stages):
        for d, (lo, hi) in plan.ranges(s).items():
            profiled = plan.microbatches * cost.step(d, spec.start, spec.end, hi - lo)
            ran = statistics.median(
                m["devices"][d]["forward_s"] + m["devices"][d]["backward_s"] for m in steady
            )
            slowdown[str(d)] = ran / profiled
    for d in DEVICES:
        slowdown.setdefault(d, 1.0)  # a device the plan left out
    predicted = simulate(plan, CostModel({"here": prof}, _cluster(slowdown))).round_s
    ratio = measured / predicted
    shape = [(s.start, s.end, [a.device for a in s.devices]) for s in plan.stages]
    assert LOW <= ratio <= HIGH, (
        f"plan {shape}: measured {measured * 1000:.0f} ms per round, simulated "
        f"{predicted * 1000:.0f} ms with the profile scaled by {slowdown} "
        f"(uncalibrated {simulate(plan, cost).round_s * 1000:.0f} ms), ratio {ratio:.2f}; "
        f"expected within [{LOW}, {HIGH}]"
    )


@pytest.mark.slow
def test_uncalibrated_simulation_predicts_real_rounds(tmp_path, redis_url, cluster_name):
    """On an idle machine the profile alone predicts the round within 30 %."""
    prof = _profile_here([1, 2, 4, 8, 16])
    cost = CostModel({"here": prof}, _cluster(dict.fromkeys(DEVICES, 1.0)))
    plan = get_planner("asteroid").plan(cost, 32, 4)
    predicted = simulate(plan, cost).round_s
    metrics = _train(tmp_path, redis_url, cluster_name, plan, 10)
    ratio = statistics.median(m["round_s"] for m in metrics[1:]) / predicted
    assert 0.7 <= ratio <= 1.3, f"measured/simulated {ratio:.2f}, expected within [0.7, 1.3]"
