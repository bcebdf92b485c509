"""Lightweight re-planning and the sample ledger, as pure functions."""

from __future__ import annotations

import itertools
import random

import pytest

from common.ids import DeviceId
from common.ledger import effective_rounds, rollback_entry, round_entry
from common.lifecycle import advance
from common.memory_model import LayerMemory, stage_bytes
from common.plan import Allocation, Plan, StageSpec
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from services.coordinator.recovery import (
    MemoryInputs,
    RecoveryImpossible,
    capacities,
    memory_inputs,
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


# --- memory ----------------------------------------------------------------------------


def bytes_per_layer(params: int, activations: int = 0, layers: int = 4) -> LayerMemory:
    """Equal layers: `params` bytes of weights and `activations` bytes per sample each."""
    return LayerMemory.of([params] * layers, [0] * layers, [activations] * layers)


def test_partition_never_chooses_a_range_that_does_not_fit():
    # the fastest split is (0, 2), (2, 4); group 0 may hold one layer at most
    assert partition([1.0] * 4, [1.0, 1.0]) == [(0, 2), (2, 4)]
    assert partition([1.0] * 4, [1.0, 1.0], lambda g, lo, hi: g > 0 or hi - lo <= 1) == [
        (0, 1),
        (1, 4),
    ]
    with pytest.raises(RecoveryImpossible, match="no split of 4 layers over 2 groups fits"):
        partition([1.0] * 4, [1.0, 1.0], lambda g, lo, hi: False)


def test_a_split_that_fits_is_chosen_over_a_faster_one_that_does_not():
    plan = plan_of((0, 1, ["a"]), (1, 2, ["b"]), (2, 4, ["c"]))
    assert [(st.start, st.end) for st in survivors_plan(plan, {DeviceId("b")}).stages] == [
        (0, 2),
        (2, 4),
    ]
    # 8 samples a micro-batch. Two stages remain, so stage 0 keeps K_p = 3 forwards in
    # flight (not the old three-stage plan's 4): one layer needs 2 x 10 + 1 x 8 x 3 = 44
    # bytes there, two layers 88; stage 1 (K_p = 1) with three layers needs 60 + 24 = 84.
    # a and c, one device each, back each other up: 10 bytes of weights a layer more,
    # so a needs 44 + 30 = 74 and c 84 + 10 = 94 (the faster split: 88 + 20 and 56 + 20).
    memory = MemoryInputs(bytes_per_layer(10, 1), {DeviceId("a"): 74, DeviceId("c"): 94})
    new = survivors_plan(plan, {DeviceId("b")}, memory=memory)
    assert [(st.start, st.end) for st in new.stages] == [(0, 1), (1, 4)]
    assert new.predicted_peak_bytes == {"a": 74, "c": 94}
    new.validate_for(4)


def test_a_split_whose_backup_does_not_fit_is_not_chosen():
    plan = plan_of((0, 1, ["a"]), (1, 2, ["b"]), (2, 4, ["c"]))
    # as above: (0, 2) | (2, 4) needs a 88 and c 56 for the stages alone, which 100 and 94
    # hold; each backs up the other's 20 bytes of weights, and a's 108 does not fit.
    # (0, 1) | (1, 4) needs a 44 + 30 = 74 and c 84 + 10 = 94, which fits.
    memory = MemoryInputs(bytes_per_layer(10, 1), {DeviceId("a"): 100, DeviceId("c"): 94})
    new = survivors_plan(plan, {DeviceId("b")}, memory=memory)
    assert [(st.start, st.end) for st in new.stages] == [(0, 1), (1, 4)]
    assert new.predicted_peak_bytes == {"a": 74, "c": 94}
    # one byte less for c and no split fits: (0, 3) | (3, 4) would need a 132 + 10
    memory = MemoryInputs(bytes_per_layer(10, 1), {DeviceId("a"): 100, DeviceId("c"): 93})
    with pytest.raises(RecoveryImpossible) as info:
        survivors_plan(plan, {DeviceId("b")}, memory=memory)
    assert str(info.value).startswith(
        "survivors cannot hold layers [1, 4): device c has 93 bytes, needs 94 "
        "with the replica of layers [0, 1) (the split closest"
    )


def test_a_group_of_several_devices_holds_no_replica_of_its_own():
    # b's loss leaves {c, d} after a: a backs up to c, but nobody backs up {c, d}
    plan = plan_of((0, 1, ["a"]), (1, 2, ["b"]), (2, 4, ["c", "d"]))
    # a (K_p = 3) on two layers: 2 x 20 + 2 x 8 x 3 = 88; c and d (4 samples, K_p = 1)
    # on two layers 40 + 8 = 48, and c holds a's 20 bytes of weights: 68
    memory = MemoryInputs(
        bytes_per_layer(10, 1), {DeviceId("a"): 88, DeviceId("c"): 68, DeviceId("d"): 48}
    )
    new = survivors_plan(plan, {DeviceId("b")}, memory=memory)
    assert [(st.start, st.end) for st in new.stages] == [(0, 2), (2, 4)]
    assert new.predicted_peak_bytes == {"a": 88, "c": 68, "d": 48}
    memory = MemoryInputs(
        bytes_per_layer(10, 1), {DeviceId("a"): 88, DeviceId("c"): 67, DeviceId("d"): 48}
    )
    with pytest.raises(RecoveryImpossible, match="device c has 67 bytes, needs 68 with the"):
        survivors_plan(plan, {DeviceId("b")}, memory=memory)


def test_each_device_of_a_group_is_checked_with_its_share_of_the_samples():
    plan = plan_of((0, 2, ["a"]), (2, 3, ["b"]), (3, 4, ["c", "d"]))
    plan = plan.model_copy(
        update={
            "stages": [
                plan.stages[0],
                plan.stages[1],
                StageSpec(
                    start=3,
                    end=4,
                    devices=[Allocation(device=DeviceId("c"), share=3), Allocation(device="d")],
                ),
            ]
        }
    )
    # c gets 6 of the 8 samples, d 2; at K_p = 1 two layers cost c 2 x (2 x 0 + 6 x 5) = 60
    # and d 20; one layer costs c 30. a (K_p = 3) holds three layers in 3 x 8 x 5 = 360.
    memory = MemoryInputs(bytes_per_layer(0, 5), {DeviceId("c"): 59, DeviceId("d"): 20})
    new = survivors_plan(plan, {DeviceId("b")}, memory=memory)
    assert [(st.start, st.end) for st in new.stages] == [(0, 3), (3, 4)]
    assert new.predicted_peak_bytes == {"a": 360, "c": 30, "d": 10}


def test_when_nothing_fits_the_message_names_the_layers_and_the_bytes():
    plan = plan_of((0, 1, ["a"]), (1, 2, ["b"]), (2, 4, ["c"]))
    # 4 layers of 20 bytes each (weights and gradients) on 30 + 30 bytes, each device
    # also holding the other's replica (10 bytes a layer): closest is 2 + 2, 60 each
    memory = MemoryInputs(bytes_per_layer(10), {DeviceId("a"): 30, DeviceId("c"): 30})
    with pytest.raises(RecoveryImpossible) as info:
        survivors_plan(plan, {DeviceId("b")}, memory=memory)
    message = str(info.value)
    assert message.startswith(
        "survivors cannot hold layers [0, 2): device a has 30 bytes, needs 60 with the "
        "replica of layers [2, 4); layers [2, 4): device c has 30 bytes, needs 60 with the "
        "replica of layers [0, 2)"
    )
    # only what does not fit is named: a holds three layers, c cannot hold even one
    # (its layer 20 bytes, a's three-layer replica 30)
    memory = MemoryInputs(bytes_per_layer(10), {DeviceId("a"): 100, DeviceId("c"): 15})
    with pytest.raises(RecoveryImpossible) as info:
        survivors_plan(plan, {DeviceId("b")}, memory=memory)
    message = str(info.value)
    assert message.startswith(
        "survivors cannot hold layers [3, 4): device c has 15 bytes, needs 50 with the "
        "replica of layers [0, 3)"
    )
    assert "device a" not in message


def test_a_budget_of_zero_or_none_is_unlimited():
    plan = plan_of((0, 1, ["a"]), (1, 2, ["b"]), (2, 4, ["c"]))
    huge = MemoryInputs(bytes_per_layer(1 << 40), {DeviceId("a"): 0})
    new = survivors_plan(plan, {DeviceId("b")}, memory=huge)
    assert new.stages == survivors_plan(plan, {DeviceId("b")}).stages
    # two layers of weights and gradients each, plus the other's two-layer replica
    assert new.predicted_peak_bytes == {"a": 6 << 40, "c": 6 << 40}


def test_memory_counts_must_describe_the_model():
    plan = plan_of((0, 2, ["a"]), (2, 4, ["b"]))
    with pytest.raises(RecoveryImpossible, match="memory counts for 3 layers, model has 4"):
        survivors_plan(plan, set(), memory=MemoryInputs(bytes_per_layer(1, layers=3)))


def test_memory_inputs_come_from_any_profile_of_the_model():
    layers = [
        LayerProfile(
            index=i,
            forward_s=[1.0],
            backward_s=[1.0],
            output_bytes=1,
            activation_bytes=3,
            param_bytes=5 + i,
            optimizer_bytes=7,
        )
        for i in range(2)
    ]
    profile = Profile(model="m", device="p", batch_sizes=[8], layers=layers)
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name="unprofiled", memory_bytes=1, profile="q"),
            DeviceSpec(name="profiled", memory_bytes=1, profile="p"),
        ]
    )
    assert memory_inputs(cluster, {}, {}) is None
    memory = memory_inputs(cluster, {"p": profile}, {DeviceId("x"): 9})
    assert memory is not None and memory.budgets == {"x": 9}
    # 2 x (5 + 6) weights and gradients + 2 x 7 optimizer + 2 x 3 x 4 samples x 2 in flight
    assert memory.layers.stage(0, 2, 4, 2) == 22 + 14 + 48
    assert memory.layers.stage(1, 2, 4, 2) == stage_bytes(6, 7, 3, 4, 2) == 12 + 7 + 24


def brute_force_with_backups(
    layers: LayerMemory, groups: list[list[str]], budgets: dict[str, int], costs: list[float]
) -> float | None:
    """The least slowest-group time over splits where every device and its replica fit.

    Written out plainly: 8-sample micro-batches split evenly, K_p = 2(S-p)-1 capped at
    4, and a single-device group's weights and optimizer state on the next group's
    first device (the last group's on the first group's), for every split in turn.
    """
    n, s = len(costs), len(groups)
    best = None
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = [0, *cuts, n]
        spans = list(itertools.pairwise(bounds))
        need = {}
        for g, (lo, hi) in enumerate(spans):
            k = min(2 * (s - g) - 1, 4)
            for d in groups[g]:
                need[d] = layers.stage(lo, hi, 8 // len(groups[g]), k)
        for g, (lo, hi) in enumerate(spans):
            if s > 1 and len(groups[g]) == 1:
                holder = groups[(g + 1) % s][0]
                p = layers.params[hi] - layers.params[lo]
                o = layers.optimizer[hi] - layers.optimizer[lo]
                need[holder] += p + o
        if any(need[d] > budgets[d] for d in need):
            continue
        worst = max(sum(costs[lo:hi]) / len(groups[g]) for g, (lo, hi) in enumerate(spans))
        best = worst if best is None else min(best, worst)
    return best


def test_survivors_plan_matches_brute_force_with_backups_on_random_instances():
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 7)
        s = rng.randint(1, min(n, 4))
        groups = [[f"g{g}a", f"g{g}b"] if rng.random() < 0.3 else [f"g{g}a"] for g in range(s)]
        layers = LayerMemory.of(
            [rng.randint(0, 9) for _ in range(n)],
            [rng.randint(0, 9) for _ in range(n)],
            [rng.randint(0, 3) for _ in range(n)],
        )
        budgets = {d: rng.randint(20, 120) for g in groups for d in g}
        costs = [float(rng.randint(1, 5)) for _ in range(n)]
        plan = plan_of(*[(g, g + 1, devs) for g, devs in enumerate(groups)])
        plan = plan.model_copy(
            update={"stages": [*plan.stages[:-1], plan.stages[-1].model_copy(update={"end": n})]}
        )
        memory = MemoryInputs(layers, {DeviceId(d): b for d, b in budgets.items()})
        want = brute_force_with_backups(layers, groups, budgets, costs)
        if want is None:
            with pytest.raises(RecoveryImpossible):
                survivors_plan(plan, set(), costs, memory=memory)
            continue
        new = survivors_plan(plan, set(), costs, memory=memory)
        ranges = [(st.start, st.end) for st in new.stages]
        assert slowest(costs, [len(g) for g in groups], ranges) == pytest.approx(want)
        assert all(new.predicted_peak_bytes[d] <= budgets[d] for d in budgets)
