"""A cluster of one GPU device and two CPU devices, planned from what their profiles say.

The planner knows nothing of accelerators: a GPU device is a fingerprint whose
profile is fast and whose budget is its card's memory. These tests check that
this is enough: the coordinator's view of the three heartbeats gives the GPU
its memory, and every planner gives it the largest share of the work.
"""

from __future__ import annotations

import pytest

from common.ids import DeviceId
from common.messages import Heartbeat
from common.plan import Plan
from common.profile import Profile
from services.coordinator.membership import Member
from services.coordinator.profiling import cluster_for
from services.planner.cost import CostModel
from services.planner.registry import get_planner
from tests.planner.fixtures import layered_profile

GiB = 1 << 30
MiB = 1 << 20
LAYERS = 8
GPU_FP = "x86_64-16c-16t-cuda_NVIDIA_H100_80GB_HBM3-79.1g-0123456789"
CPU_FP = "aarch64-4c-4t-3.7g-abcdef0123"
SPEEDUP = 20.0
"""How much faster the GPU's profile is than the CPUs' (an H100 against a Pi is far more)."""


def _profile(scale: float) -> Profile:
    return layered_profile(
        forward_s=[scale * 2.0**-10] * LAYERS,
        out_bytes=[64 << 10] * LAYERS,
        act_bytes=[256 << 10] * LAYERS,
        param_bytes=[4 * MiB] * LAYERS,
    )


def _beat(name: str, fingerprint: str, budget: int, threads: int, cores: int) -> Heartbeat:
    return Heartbeat(
        device=DeviceId(name),
        data_addr="tcp://127.0.0.1:1",
        fingerprint=fingerprint,
        threads=threads,
        cores=cores,
        memory_budget=budget,
    )


def _cost() -> CostModel:
    beats = [
        _beat("jetson-or-desktop", GPU_FP, 70 * GiB, 16, 16),
        _beat("pi-1", CPU_FP, 2 * GiB, 4, 4),
        _beat("pi-2", CPU_FP, 2 * GiB, 4, 4),
    ]
    members = {hb.device: Member(hb.device, 0.0, hb) for hb in beats}
    keys = {hb.device: hb.fingerprint for hb in beats}
    cluster = cluster_for(members, keys, {GPU_FP: 0, CPU_FP: 0}, None, 125e6)
    profiles = {GPU_FP: _profile(1 / SPEEDUP), CPU_FP: _profile(1.0)}
    return CostModel(profiles, cluster)


def _work(plan: Plan) -> dict[str, float]:
    """Layer-samples each device computes per micro-batch (every layer costs the same)."""
    work: dict[str, float] = {}
    for stage in plan.stages:
        for a in stage.devices:
            work[str(a.device)] = work.get(str(a.device), 0.0) + a.share * (stage.end - stage.start)
    return work


def test_the_gpu_device_is_planned_with_its_cards_memory() -> None:
    cluster = _cost().cluster
    memory = {d.name: d.memory_bytes for d in cluster.devices}
    assert memory == {"jetson-or-desktop": 70 * GiB, "pi-1": 2 * GiB, "pi-2": 2 * GiB}
    assert {d.name: d.profile for d in cluster.devices}["jetson-or-desktop"] == GPU_FP


@pytest.mark.parametrize("planner", ["asteroid", "dp", "hetpipe"])  # speed-aware planners
def test_the_gpu_device_gets_the_largest_share(planner: str) -> None:
    plan = get_planner(planner).plan(_cost(), global_batch=64, microbatches=4)
    work = _work(plan)
    gpu = work.get("jetson-or-desktop", 0.0)
    assert gpu > max(work.get("pi-1", 0.0), work.get("pi-2", 0.0)), (planner, work)
    assert gpu >= sum(work.values()) / 2, (planner, work)
