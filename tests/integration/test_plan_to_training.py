"""A profile taken here, a plan made from it, real training rounds with that plan:
the measured round time is within 30% of the simulator's prediction.

Marked slow: the profile and the rounds must see the same machine, so this is
meaningful only on an otherwise idle machine (run it with `make test-slow`); a
concurrent load during either half skews the ratio either way.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from common.profile import ClusterSpec, DeviceSpec
from common.zoo import ModelSpec
from services.planner.base import get_planner
from services.planner.cost import CostModel
from services.planner.simulator import simulate
from services.profiler.layers import profile_model
from tests.integration.test_equivalence import run_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}
ROUNDS = 10


def test_simulated_round_time_predicts_real_rounds(tmp_path, redis_url, cluster_name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        prof = profile_model(
            ModelSpec.model_validate(MODEL),
            [1, 2, 4, 8, 16],
            repeats=3,
            warmup=1,
            memory_budget=2 << 30,
        )
    finally:
        torch.set_num_threads(threads)
    cluster = ClusterSpec(
        devices=[DeviceSpec(name=n, memory_bytes=2 << 30, profile="here") for n in ("w0", "w1")],
        bandwidth=1e9,  # loopback
    )
    cost = CostModel({"here": prof}, cluster)
    plan = get_planner("asteroid").plan(cost, 32, 4)
    predicted = simulate(plan, cost).round_s
    stages = [s.model_dump(mode="json") for s in plan.stages]
    _, _, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        MODEL,
        stages,
        rounds=ROUNDS,
        m=plan.microbatches,
        batch=plan.global_batch,
        optimizer={"kind": "sgd", "lr": 0.01, "momentum": 0.9},
    )
    measured = statistics.median(m["round_s"] for m in metrics[1:] if "round_s" in m)
    ratio = measured / predicted
    print(
        f"plan {[(s.start, s.end, [a.device for a in s.devices]) for s in plan.stages]}: "
        f"measured {measured * 1000:.0f} ms, simulated {predicted * 1000:.0f} ms, "
        f"ratio {ratio:.2f}"
    )
    assert 0.7 <= ratio <= 1.3
