"""Async stages hold stashed weight versions; the planners' memory check counts them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.memory_model import stashed_copies
from common.plan import Plan
from services.planner.base import PlanDoesNotFit, finish, stage
from tests.planner.fixtures import hetero_cost, layered_profile

F = 2.0**-10
PROFILE = layered_profile([F] * 3, [0, 0, 0], [2, 2, 2], [10, 20, 30])
PLAN = Plan.model_validate(
    {
        "global_batch": 8,
        "microbatches": 4,
        "stages": [
            {"start": 0, "end": 1, "devices": [{"device": "a"}]},
            {"start": 1, "end": 3, "devices": [{"device": "b"}]},
        ],
    }
)


def test_stashed_copies_are_the_k0_versions_to_come_the_new_one_and_the_averaged_ones():
    # every stage, whatever its own K_s, keeps the versions of the next K_0 micro-batches
    assert stashed_copies(3, aggregate=False) == 4
    assert stashed_copies(3, aggregate=True) == 3 + 1 + 3


@pytest.mark.parametrize("aggregate", [False, True])
def test_an_async_plan_needs_the_sync_bytes_plus_its_stashed_weights(aggregate):
    sync = hetero_cost([("a", 1.0, 1 << 20), ("b", 1.0, 1 << 20)], PROFILE)
    cost = replace(sync, mode="async", aggregate=aggregate)
    before, after = sync.plan_memory(PLAN), cost.plan_memory(PLAN)
    k0 = PLAN.warmup(0)  # 3: two stages, 2S - 1
    # stage 0: 10 bytes of weights, stage 1: 50 bytes; each keeps K_0 + 1 versions
    extra = {
        "a": 10 * (3 + 1 + (k0 if aggregate else 0)),
        "b": 50 * (3 + 1 + (k0 if aggregate else 0)),
    }
    assert {d: after[d] - before[d] for d in before} == extra


def test_a_planner_refuses_an_async_plan_whose_stash_does_not_fit():
    specs = [stage(0, 1, ["a"], [1]), stage(1, 3, ["b"], [1])]
    roomy = hetero_cost([("a", 1.0, 1 << 20), ("b", 1.0, 1 << 20)], PROFILE)
    need = finish("manual", roomy, specs, 8, 4, memory_aware=True).predicted_peak_bytes["a"]
    # a has room for its sync peak but not for async's 4 more copies of its 10 bytes
    sync = hetero_cost([("a", 1.0, need + 39), ("b", 1.0, 1 << 20)], PROFILE)
    finish("manual", sync, specs, 8, 4, memory_aware=True)
    with pytest.raises(PlanDoesNotFit, match="device a needs"):
        finish("manual", replace(sync, mode="async"), specs, 8, 4, memory_aware=True)
