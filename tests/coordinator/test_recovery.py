"""Lightweight re-planning and the sample ledger, as pure functions."""

from __future__ import annotations

import itertools
import random

import pytest

from common.ids import DeviceId
from common.ledger import effective_rounds, rollback_entry, round_entry
from common.lifecycle import advance
from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from services.coordinator.recovery import (
    RecoveryImpossible,
    capacities,
    partition,
    survivors_plan,
)


def plan_of(*stages: tuple[int, int, list[str]]) -> Plan:
    return Plan.model_validate(
        {
            "global_batch": 32,
            "microbatches": 4,
            "stages": [
                {"start": lo, "end": hi, "devices": [{"device": d} for d in devs]}
                for lo, hi, devs in stages
            ],
        }
    )


def brute_force(costs: list[float], capacity: list[float]) -> float:
    """The least slowest-group time over every contiguous split, computed the plain way."""
    n, s = len(costs), len(capacity)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[bounds[g] : bounds[g + 1]]) / capacity[g] for g in range(s))
        best = min(best, worst)
    return best


def slowest(costs: list[float], capacity: list[float], ranges: list[tuple[int, int]]) -> float:
    return max(sum(costs[lo:hi]) / c for (lo, hi), c in zip(ranges, capacity, strict=True))


def test_partition_matches_brute_force_on_random_instances():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 9)
        s = rng.randint(1, n)
        costs = [rng.uniform(0.1, 5) for _ in range(n)]
        capacity = [rng.uniform(0.5, 3) for _ in range(s)]
        ranges = partition(costs, capacity)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(lo < hi for lo, hi in ranges)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert slowest(costs, capacity, ranges) == pytest.approx(brute_force(costs, capacity))


def test_partition_follows_capacity():
    # a group twice as fast takes twice the layers of equal cost
    assert partition([1.0] * 6, [2.0, 1.0]) == [(0, 4), (4, 6)]
    assert partition([1.0] * 6, [1.0, 2.0]) == [(0, 2), (2, 6)]


def test_partition_refuses_what_cannot_be_split():
    with pytest.raises(RecoveryImpossible, match="no device group survives"):
        partition([1.0], [])
    with pytest.raises(RecoveryImpossible, match="3 groups survive but the model has only 2"):
        partition([1.0, 1.0], [1.0, 1.0, 1.0])


def test_a_lost_single_device_stage_disappears_and_its_layers_move_to_neighbours():
    plan = plan_of((0, 2, ["a"]), (2, 5, ["b"]), (5, 7, ["c", "d"]))
    new = survivors_plan(plan, {DeviceId("b")})
    assert [[a.device for a in st.devices] for st in new.stages] == [["a"], ["c", "d"]]
    # equal layers, capacities 1 and 2: 2 layers to a and 5 to c+d (slowest 2.5),
    # not 3 and 4 (slowest 3)
    assert [(st.start, st.end) for st in new.stages] == [(0, 2), (2, 7)]
    new.validate_for(7)
    assert new.global_batch == 32 and new.microbatches == 4
    assert new.planner == "manual+lightweight"


def test_a_lost_group_member_leaves_its_group_and_the_points_follow_capacity():
    plan = plan_of((0, 2, ["a"]), (2, 5, ["b"]), (5, 7, ["c", "d"]))
    new = survivors_plan(plan, {DeviceId("d")})
    assert [[a.device for a in st.devices] for st in new.stages] == [["a"], ["b"], ["c"]]
    new.validate_for(7)
    speeds = {DeviceId("a"): 1.0, DeviceId("b"): 4.0, DeviceId("c"): 1.0}
    faster_b = survivors_plan(plan, {DeviceId("d")}, [1.0] * 7, speeds)
    assert [(st.start, st.end) for st in faster_b.stages] == [(0, 1), (1, 6), (6, 7)]


def test_nothing_survives():
    plan = plan_of((0, 7, ["a", "b"]))
    with pytest.raises(RecoveryImpossible, match="no device group survives"):
        survivors_plan(plan, {DeviceId("a"), DeviceId("b")})


def test_capacities_come_from_profiles_and_slowdowns():
    def profile(key: str, per_layer: list[float]) -> Profile:
        layers = [
            LayerProfile(
                index=i,
                forward_s=[t, 2 * t],
                backward_s=[t, 2 * t],
                output_bytes=1,
                activation_bytes=1,
                param_bytes=1,
                optimizer_bytes=1,
            )
            for i, t in enumerate(per_layer)
        ]
        return Profile(model="m", device=key, batch_sizes=[8, 16], layers=layers)

    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name="fast", memory_bytes=1, profile="p"),
            DeviceSpec(name="slow", memory_bytes=1, profile="p", slowdown=3.0),
        ]
    )
    costs, speeds = capacities(cluster, {"p": profile("p", [1.0, 3.0])}, batch=16)
    # at batch 16 a layer takes 4t (forward 2t + backward 2t); the mean over devices
    assert costs == pytest.approx([8.0, 24.0])
    assert speeds["fast"] == pytest.approx(1 / 16) and speeds["slow"] == pytest.approx(1 / 48)
    with pytest.raises(RecoveryImpossible, match="no profiles"):
        capacities(cluster, {}, batch=16)


def test_the_ledger_keeps_what_survives_rollbacks():
    entries = [
        round_entry(0, 1, 0, 4, [0, 1, 2, 3]),
        round_entry(1, 1, 4, 8, [4, 5, 6, 7]),
        round_entry(2, 1, 8, 12, [8, 9, 10, 11]),
        rollback_entry(1, ["b"]),
        round_entry(1, 2, 4, 8, [4, 5, 6, 7]),
        round_entry(2, 2, 8, 12, [8, 9, 10, 11]),
    ]
    kept = effective_rounds(entries)
    assert [(e["round"], e["epoch"]) for e in kept] == [(0, 1), (1, 2), (2, 2)]


def test_the_ledger_refuses_a_round_applied_twice():
    twice = [round_entry(0, 1, 0, 4, []), round_entry(0, 1, 0, 4, [])]
    with pytest.raises(ValueError, match="round 0 committed after round 0"):
        effective_rounds(twice)


def test_recovering_is_a_state_between_running_and_running():
    assert advance("running", "recovering") == "recovering"
    assert advance("recovering", "running") == "running"
    assert advance("recovering", "failed") == "failed"
    with pytest.raises(Exception, match="a recovering job cannot become finished"):
        advance("recovering", "finished")
