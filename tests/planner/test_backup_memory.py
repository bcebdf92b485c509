"""A backup node's replica counts against its budget in every memory-aware planner.

Two equal devices and two layers of 10 bytes of weights, 10 of optimizer state
and 2 bytes of activations per sample; 16 samples in 4 micro-batches of 4. The
link is slow, so an all-reduce costs more than a pipeline's boundary:

  * pipeline [0, 1) | [1, 2), one device each: the first stage keeps K = 3
    micro-batches, 2 x 10 + 10 + 3 x 4 x 2 = 54 bytes, the second 30 + 4 x 2 = 38;
    each backs up the other's 20-byte replica (weights + optimizer), so 74 and 58.
  * one stage [0, 2) on both, 2 samples each: 2 x 20 + 20 + 2 x 2 x 2 = 68 bytes,
    no replica (the peer is the replica).
  * one device alone on [0, 2): 60 + 4 x 4 = 76 bytes.

With 70 bytes each, only the data-parallel plan fits once replicas count; the
faster pipeline would fit on stage memory alone (54 and 38).
"""

from __future__ import annotations

import pytest

from common.plan import Plan
from services.planner.balance import fit_backups
from services.planner.base import PlanDoesNotFit, check_memory
from services.planner.cost import CostModel
from services.planner.registry import get_planner
from services.planner.simulator import simulate
from tests.planner.fixtures import hetero_cost, layered_profile, make_plan


def two_layer_cost(budget: int) -> CostModel:
    """The instance of the module docstring, every device with `budget` bytes."""
    profile = layered_profile(
        forward_s=[2.0**-10] * 2, out_bytes=[0, 0], act_bytes=[2, 2], param_bytes=[10, 10]
    )
    return hetero_cost([("a", 1.0, budget), ("b", 1.0, budget)], profile, bandwidth=100.0)


def layout(plan: Plan) -> list[tuple[int, int, list[str]]]:
    return [(s.start, s.end, [a.device for a in s.devices]) for s in plan.stages]


PIPELINE = make_plan([(0, 1, {"a": 1}), (1, 2, {"b": 1})], 16, 4)
DATA_PARALLEL = make_plan([(0, 2, {"a": 1, "b": 1})], 16, 4)


def test_the_pipeline_is_faster_and_fits_only_without_its_replicas() -> None:
    cost = two_layer_cost(70)
    assert simulate(PIPELINE, cost).round_s < simulate(DATA_PARALLEL, cost).round_s
    assert cost.reserved(PIPELINE) == {"a": 20, "b": 20}
    assert cost.plan_memory(PIPELINE) == {"a": 74, "b": 58}
    assert cost.memory(0, 1, 4, 3) == 54  # the pipeline's stage memory alone fits 70
    assert len(check_memory(PIPELINE, cost)) == 1  # a, 74 bytes of 70
    assert cost.plan_memory(DATA_PARALLEL) == {"a": 68, "b": 68}


@pytest.mark.parametrize("name", ["asteroid", "duanwu", "optimal"])
def test_a_memory_aware_planner_picks_the_plan_whose_backups_fit(name: str) -> None:
    cost = two_layer_cost(70)
    plan = get_planner(name).plan(cost, 16, 4)
    assert layout(plan) == [(0, 2, ["a", "b"])]
    assert plan.predicted_peak_bytes == {"a": 68, "b": 68}


@pytest.mark.parametrize("name", ["asteroid", "duanwu", "optimal"])
def test_with_room_for_the_replicas_the_pipeline_wins(name: str) -> None:
    cost = two_layer_cost(74)
    plan = get_planner(name).plan(cost, 16, 4)
    assert [(lo, hi) for lo, hi, _ in layout(plan)] == [(0, 1), (1, 2)]
    assert sorted(plan.predicted_peak_bytes.values()) == [58, 74]


def test_a_planner_that_cannot_fit_the_backups_says_which_device_overflows() -> None:
    # 67 bytes: the data-parallel plan needs 68, the pipeline's first device 74
    with pytest.raises(PlanDoesNotFit, match=r"device \w needs"):
        get_planner("asteroid").plan(two_layer_cost(67), 16, 4)


def test_fit_backups_moves_samples_off_the_member_holding_a_replica() -> None:
    # c alone on [0, 1) backs up to a, the first device of group {a, b} on [1, 2) (K = 1,
    # 4-sample micro-batches). With n samples a needs 2 x 10 + 10 + 2n = 30 + 2n bytes
    # plus c's 20-byte replica, b 30 + 2n. At 52 bytes a has room for 1 sample, not 2.
    cost = hetero_cost(
        [("a", 1.0, 52), ("b", 1.0, 52), ("c", 1.0, 1 << 20)],
        layered_profile(
            forward_s=[2.0**-10] * 2, out_bytes=[0, 0], act_bytes=[2, 2], param_bytes=[10, 10]
        ),
    )
    plan = make_plan([(0, 1, {"c": 1}), (1, 2, {"a": 2, "b": 2})], 16, 4)
    # c keeps K = 3 micro-batches: 30 + 3 x 4 x 2 = 54 and holds no replica
    assert cost.plan_memory(plan) == {"c": 54, "a": 54, "b": 34}
    fitted = fit_backups(cost, plan)
    assert fitted is not None
    assert fitted.ranges(1) == {"a": (0, 1), "b": (1, 4)}
    assert cost.plan_memory(fitted) == {"c": 54, "a": 52, "b": 36}
    assert fitted.stages[0] == plan.stages[0]


def test_fit_backups_gives_up_when_the_replica_leaves_no_room() -> None:
    cost = two_layer_cost(70)
    # a's own stage takes 54 bytes, so with b's 20-byte replica only 70 - 50 = 20 bytes
    # are left for activations: 3 samples' worth (3 x 2 x 3 = 18), not the 4 of its share
    assert fit_backups(cost, PIPELINE) is None
