"""The consistent cut and the peer-to-peer layer moves after a loss, as pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.ids import DeviceId
from common.plan import Plan
from services.coordinator.migration import Replica, Transfers, cut_version, transfers
from services.coordinator.recovery import RecoveryImpossible, survivors_plan


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


def ids(*names: str) -> set[DeviceId]:
    return {DeviceId(n) for n in names}


def replica(origin: str, start: int, end: int, version: int, holder: str) -> Replica:
    return Replica(DeviceId(origin), start, end, version, DeviceId(holder))


A, B, C, D, E = (DeviceId(n) for n in "ABCDE")
# [A] [B, C] [D]: six layers, two per stage
THREE = plan_of((0, 2, ["A"]), (2, 4, ["B", "C"]), (4, 6, ["D"]))


# --- cut_version -------------------------------------------------------------------------


def test_losing_a_device_whose_peer_survives_keeps_the_committed_version() -> None:
    assert cut_version(THREE, ids("B"), 7, []) == 7
    assert cut_version(THREE, ids("C"), 7, [replica("A", 0, 2, 3, "B")]) == 7


def test_no_loss_keeps_the_committed_version() -> None:
    assert cut_version(THREE, set(), 5, []) == 5


def test_a_lost_single_device_stage_resumes_from_its_newest_replica() -> None:
    replicas = [replica("A", 0, 2, 4, "B"), replica("A", 0, 2, 6, "B")]
    assert cut_version(THREE, ids("A"), 7, replicas) == 6


def test_a_replica_at_the_committed_version_gives_the_committed_version() -> None:
    assert cut_version(THREE, ids("D"), 7, [replica("D", 4, 6, 7, "A")]) == 7


def test_a_lost_stage_whose_replica_holder_is_also_lost_has_no_cut() -> None:
    replicas = [replica("A", 0, 2, 4, "B"), replica("A", 0, 2, 6, "B")]
    assert cut_version(THREE, ids("A", "B"), 7, replicas) is None


def test_a_lost_stage_without_any_replica_has_no_cut() -> None:
    assert cut_version(THREE, ids("B", "C"), 7, []) is None


FOUR = plan_of((0, 1, ["A"]), (1, 3, ["B", "C"]), (3, 4, ["D"]), (4, 6, ["E"]))


def test_two_lost_stages_resume_from_the_newest_version_both_have() -> None:
    replicas = [
        replica("A", 0, 1, 4, "B"),
        replica("A", 0, 1, 6, "B"),
        replica("D", 3, 4, 4, "E"),
    ]
    assert cut_version(FOUR, ids("A", "D"), 7, replicas) == 4
    both_at_six = [*replicas, replica("D", 3, 4, 6, "E")]
    assert cut_version(FOUR, ids("A", "D"), 7, both_at_six) == 6


def test_two_lost_stages_without_a_shared_version_have_no_cut() -> None:
    replicas = [replica("A", 0, 1, 6, "B"), replica("D", 3, 4, 5, "E")]
    assert cut_version(FOUR, ids("A", "D"), 7, replicas) is None


def test_a_replica_newer_than_the_committed_version_is_ignored() -> None:
    assert cut_version(THREE, ids("A"), 7, [replica("A", 0, 2, 8, "B")]) is None
    replicas = [replica("A", 0, 2, 8, "B"), replica("A", 0, 2, 5, "C")]
    assert cut_version(THREE, ids("A"), 7, replicas) == 5


def test_a_replica_of_part_of_the_stage_does_not_cover_it() -> None:
    assert cut_version(THREE, ids("A"), 7, [replica("A", 0, 1, 6, "B")]) is None


# --- transfers -----------------------------------------------------------------------------


def test_unchanged_boundaries_move_nothing() -> None:
    new = survivors_plan(THREE, ids("B"))
    assert [(s.start, s.end) for s in new.stages] == [(0, 2), (2, 4), (4, 6)]
    t = transfers(THREE, new, ids("B"), 7, [])
    assert t == Transfers(sources={}, sends={}, moved=0, moved_bytes=0, local={})


def test_moved_boundaries_move_only_the_layers_that_change_hands() -> None:
    new = plan_of((0, 1, ["A"]), (1, 3, ["C"]), (3, 6, ["D"]))
    t = transfers(THREE, new, ids("B"), 7, [], layer_bytes=[10, 20, 30, 40, 50, 60])
    assert t.sources == {C: {1: A}, D: {3: C}}
    assert t.sends == {A: {C: [1]}, C: {D: [3]}}
    assert (t.moved, t.moved_bytes) == (2, 20 + 40)
    assert t.local == {}


def test_a_replica_holder_promotes_its_copy_and_feeds_its_peer() -> None:
    replicas = [replica("A", 0, 2, 4, "B"), replica("A", 0, 2, 6, "B")]
    new = survivors_plan(THREE, ids("A"))
    # capacities 2 ([B, C]) and 1 ([D]): six layers split 4 and 2
    assert [(s.start, s.end) for s in new.stages] == [(0, 4), (4, 6)]
    t = transfers(THREE, new, ids("A"), 6, replicas)
    assert t.local == {B: [0, 1]}
    assert t.sources == {C: {0: B, 1: B}}
    assert t.sends == {B: {C: [0, 1]}}
    assert (t.moved, t.moved_bytes) == (2, 2)


def test_a_layer_nobody_holds_at_the_version_is_named() -> None:
    replicas = [replica("A", 0, 2, 4, "B"), replica("A", 0, 2, 6, "B")]
    new = survivors_plan(THREE, ids("A"))
    with pytest.raises(RecoveryImpossible, match="device B needs layers 0, 1 at version 7"):
        transfers(THREE, new, ids("A"), 7, replicas)


def test_a_lost_device_is_never_a_source() -> None:
    old = plan_of((0, 2, ["A"]), (2, 4, ["B"]), (4, 6, ["C"]))
    replicas = [replica("A", 0, 2, 5, "Z"), replica("A", 0, 2, 5, "C")]
    new = survivors_plan(old, ids("A"))
    assert [(s.start, s.end) for s in new.stages] == [(0, 3), (3, 6)]
    t = transfers(old, new, ids("A", "Z"), 5, replicas)
    assert t.sources == {B: {0: C, 1: C}, C: {3: B}}


def test_no_transfer_to_a_device_that_already_held_the_layer() -> None:
    old = plan_of((0, 3, ["A"]), (3, 6, ["B"]))
    new = plan_of((0, 4, ["A"]), (4, 6, ["B"]))
    t = transfers(old, new, set(), 2, [])
    assert t.sources == {A: {3: B}}
    assert t.received_by(B) == {}
    assert t.sent_by(A) == {}
    assert t.sent_by(B) == {A: [3]}


def test_a_new_device_fetches_its_whole_range() -> None:
    old = plan_of((0, 2, ["A"]), (2, 4, ["B"]))
    new = plan_of((0, 2, ["A", "N"]), (2, 4, ["B"]))
    t = transfers(old, new, set(), 2, [])
    assert t.sources == {DeviceId("N"): {0: A, 1: A}}


def test_load_spreads_over_every_holder() -> None:
    old = plan_of((0, 4, ["A", "B"]), (4, 6, ["C"]))
    new = plan_of((0, 1, ["A", "B"]), (1, 6, ["C"]))
    t = transfers(old, new, set(), 3, [])
    assert t.sources == {C: {1: A, 2: B, 3: A}}
    assert t.sends == {A: {C: [1, 3]}, B: {C: [2]}}


def test_load_is_counted_in_bytes() -> None:
    old = plan_of((0, 4, ["A", "B"]), (4, 6, ["C"]))
    new = plan_of((0, 1, ["A", "B"]), (1, 6, ["C"]))
    t = transfers(old, new, set(), 3, [], layer_bytes=[1, 9, 1, 1, 1, 1])
    # layer 1 (9 bytes) to A; then B is lighter for both small layers
    assert t.sources == {C: {1: A, 2: B, 3: B}}
    assert (t.moved, t.moved_bytes) == (3, 11)


def test_a_stage_device_is_preferred_over_a_replica_holder_at_equal_load() -> None:
    w, x, a = DeviceId("w"), DeviceId("x"), DeviceId("a")
    old = plan_of((0, 3, ["w"]), (3, 5, ["x"]), (5, 6, ["a"]))
    new = plan_of((0, 1, ["w"]), (1, 5, ["x"]), (5, 6, ["a"]))
    replicas = [replica("w", 0, 3, 3, "a")]
    assert transfers(old, new, set(), 3, replicas).sources == {x: {1: w, 2: a}}
    # a replica at another version is no holder
    assert transfers(old, new, set(), 4, replicas).sources == {x: {1: w, 2: w}}


def test_output_is_deterministic_and_sorted() -> None:
    old = plan_of((0, 2, ["C"]), (2, 4, ["A", "B"]), (4, 8, ["D"]))
    new = plan_of((0, 3, ["B", "C"]), (3, 8, ["D"]))
    replicas = [replica("C", 0, 2, 1, "D"), replica("C", 0, 2, 1, "A")]
    first = transfers(old, new, ids("A"), 1, replicas)
    again = transfers(old, new, frozenset(ids("A")), 1, list(reversed(replicas)))
    assert first == again
    assert list(first.sources) == list(again.sources) == sorted(first.sources)
    assert list(first.sends) == list(again.sends) == sorted(first.sends)
    # B fetches 0 from C (stage device first), then 1 from D (C now carries a byte);
    # A is lost, so B is the only source of 2 and 3
    assert first.sources == {B: {0: C, 1: D}, C: {2: B}, D: {3: B}}
    assert first.sends == {B: {C: [2], D: [3]}, C: {B: [0]}, D: {B: [1]}}


def test_plans_of_different_models_are_refused() -> None:
    new = plan_of((0, 3, ["A"]), (3, 7, ["C"]))
    with pytest.raises(RecoveryImpossible, match="new plan covers 7 layers, old plan covers 6"):
        transfers(THREE, new, ids("B"), 1, [])


def test_a_new_plan_with_a_lost_device_is_refused() -> None:
    with pytest.raises(RecoveryImpossible, match="lost devices B"):
        transfers(THREE, THREE, ids("B"), 1, [])


def test_layer_sizes_must_match_the_model() -> None:
    with pytest.raises(RecoveryImpossible, match="5 layer sizes for a model of 6 layers"):
        transfers(THREE, THREE, set(), 1, [], layer_bytes=[1] * 5)


# --- property: every device of the re-planned pipeline ends up with its layers ---------------


@st.composite
def losses(draw: st.DrawFn) -> tuple[Plan, set[DeviceId], int, list[Replica]]:
    """A plan of 2-4 stages, a loss that spares someone, and next-stage replicas at `committed`."""
    stages = draw(st.integers(2, 4))
    layers = draw(st.integers(stages, 9))
    cuts = sorted(
        draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))
    )
    bounds = [0, *cuts, layers]
    sizes = [draw(st.integers(1, 3)) for _ in range(stages)]
    names = iter(f"d{i}" for i in range(sum(sizes)))
    groups = [[next(names) for _ in range(n)] for n in sizes]
    plan = plan_of(*((bounds[i], bounds[i + 1], groups[i]) for i in range(stages)))
    everyone = [d for g in groups for d in g]
    lost = draw(st.sets(st.sampled_from(everyone), max_size=len(everyone) - 1))
    committed = draw(st.integers(1, 10))
    replicas = []
    for i, group in enumerate(groups):
        if len(group) == 1:
            holder = draw(st.sampled_from(groups[(i + 1) % stages]))
            for v in (committed - 1, committed):
                replicas.append(replica(group[0], bounds[i], bounds[i + 1], v, holder))
    return plan, {DeviceId(d) for d in lost}, committed, replicas


def holds(
    device: DeviceId, layer: int, old: Plan, lost: set[DeviceId], reps: list[Replica]
) -> bool:
    """Whether `device` survives with `layer` at the version of `reps`, checked the plain way."""
    if device in lost:
        return False
    ran = any(
        s.start <= layer < s.end and device in [a.device for a in s.devices] for s in old.stages
    )
    return ran or any(r.holder == device and r.start <= layer < r.end for r in reps)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(losses())
def test_every_device_of_the_new_plan_gets_every_layer(
    case: tuple[Plan, set[DeviceId], int, list[Replica]],
) -> None:
    old, lost, committed, replicas = case
    hopeless = any(
        all(a.device in lost for a in s.devices)
        and (len(s.devices) > 1 or all(r.holder in lost for r in replicas if r.start == s.start))
        for s in old.stages
    )
    cut = cut_version(old, lost, committed, replicas)
    assert cut == (None if hopeless else committed)
    new = survivors_plan(old, lost)
    if cut is None:
        with pytest.raises(RecoveryImpossible):
            transfers(old, new, lost, committed, replicas)
        return
    at_cut = [r for r in replicas if r.version == cut]
    t = transfers(old, new, lost, cut, replicas)
    for stage in new.stages:
        for device in (a.device for a in stage.devices):
            ran_before = {
                layer
                for s in old.stages
                if device in [a.device for a in s.devices]
                for layer in range(s.start, s.end)
            }
            for layer in range(stage.start, stage.end):
                if layer in ran_before:
                    assert layer not in t.received_by(device)
                elif layer in t.local.get(device, []):
                    assert holds(device, layer, old, lost, at_cut)
                else:
                    source = t.received_by(device)[layer]
                    assert source != device
                    assert source not in lost
                    assert holds(source, layer, old, lost, at_cut)
    pairs = [(s, r, layer) for s, to in t.sends.items() for r, ls in to.items() for layer in ls]
    assert sorted(pairs) == sorted(
        (s, r, layer) for r, got in t.sources.items() for layer, s in got.items()
    )
    assert t.moved == len(pairs) == t.moved_bytes
