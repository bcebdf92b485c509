"""A plan predicts how long a round communicates, by the cost model that predicts the round.

The job core compares it with the waits the workers report (`link_drift`):
a plan made on fast links predicts only the pipeline's own bubbles, one made
on slow links much more; a plan stored before the prediction existed loads
with 0 (unknown).
"""

from __future__ import annotations

import pytest

from common.messages import PlanRequest
from common.plan import Plan
from services.planner.base import finish
from services.planner.service import make_plan as make_plan_for
from services.planner.simulator import estimate, estimate_parts
from tests.planner.fixtures import make_cost, make_plan, make_profile

DEVICES = {"a": 1.0, "b": 1.0}
PIPELINE = [(0, 4, {"a": 1}), (4, 8, {"b": 1})]


def _planned(bandwidth: float) -> Plan:
    cost = make_cost(DEVICES, bandwidth=bandwidth)
    stages = make_plan(PIPELINE, 32, 4).stages
    return finish("asteroid", cost, stages, 32, 4, memory_aware=False)


def test_the_round_splits_into_compute_and_what_the_least_busy_device_waits():
    cost = make_cost(DEVICES, bandwidth=1e6)
    plan = make_plan(PIPELINE, 32, 4)
    round_s, comm_s = estimate_parts(plan, cost)
    assert round_s == estimate(plan, cost)
    one_step = cost.step("a", 0, 4, 8)
    assert comm_s == pytest.approx(round_s - plan.microbatches * one_step)


def test_a_plan_on_fast_links_predicts_little_communication_one_on_slow_links_much():
    fast, slow = _planned(1e18), _planned(1e5)
    assert fast.predicted_round_s is not None and slow.predicted_round_s is not None
    # on fast links only the pipeline's fill and drain: one stage's step of four
    assert fast.predicted_comm_s == pytest.approx(fast.predicted_round_s / 5)
    assert slow.predicted_comm_s > 10 * fast.predicted_comm_s
    assert slow.predicted_round_s - slow.predicted_comm_s == pytest.approx(
        fast.predicted_round_s - fast.predicted_comm_s
    )  # the compute is the same


def test_one_device_never_waits_and_old_plans_load_unknown():
    cost = make_cost({"a": 1.0})
    alone = finish(
        "asteroid", cost, make_plan([(0, 8, {"a": 1})], 32, 4).stages, 32, 4, memory_aware=False
    )
    assert alone.predicted_comm_s == 0.0
    old = make_plan(PIPELINE, 32, 4).model_dump(mode="json")
    del old["predicted_comm_s"]
    assert Plan.model_validate(old).predicted_comm_s == 0.0


def test_the_planner_service_predicts_the_running_plan_on_the_same_cluster(store):
    profile = make_profile()
    store.put_json(profile.model_dump(mode="json"), "profile", "ref")
    cost = make_cost(DEVICES, bandwidth=1e5)
    running = make_plan(PIPELINE, 32, 4)
    req = PlanRequest(
        job_id="j",
        planner="asteroid",
        cluster=cost.cluster,
        profiles=["ref"],
        global_batch=32,
        microbatches=4,
    )
    plan, none = make_plan_for(store, req)
    assert none == 0.0 and plan.predicted_round_s
    assert store.get_json("plan", "j") is None  # the plan travels in the reply, not Redis
    _, current_s = make_plan_for(store, req.model_copy(update={"current": running}))
    assert current_s == estimate(running, cost) > 0
    stranger = make_plan([(0, 4, {"a": 1}), (4, 8, {"z": 1})], 32, 4)
    assert make_plan_for(store, req.model_copy(update={"current": stranger}))[1] == 0.0
