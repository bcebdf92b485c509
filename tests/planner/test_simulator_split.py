"""The round simulator on devices that split their compute between a forward and a backward lane.

A device whose allocation has `forward_share` beta runs `next_pair`'s backward
and forward together, a forward lasting F / beta and a backward B / (1 - beta),
and decides again only when both ended. Timelines below are worked out by hand
from the profile (time unit U = 2^-10 s: one layer on one sample at slowdown 1
takes F = 1 U forward and B = 2 U backward); lane durations divide by 1/3 and
2/3, which binary floating point does not hold exactly, hence `approx`.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest

from common.plan import Plan
from services.planner.cost import CostModel
from services.planner.duanwu import optimal_beta
from services.planner.simulator import Event, SimResult, simulate
from tests.planner.fixtures import hetero_cost, layered_profile, make_cost, make_plan, make_profile

U = 2.0**-10
THIRD = 1 / 3  # F = 1, B = 2 -> both lanes last F + B = 3


def split(plan: Plan, betas: dict[str, float | None]) -> Plan:
    """`plan` with the given devices' forward shares set (the others untouched)."""
    stages = [
        spec.model_copy(
            update={
                "devices": [
                    a.model_copy(update={"forward_share": betas[a.device]})
                    if a.device in betas
                    else a
                    for a in spec.devices
                ]
            }
        )
        for spec in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


def compute(res: SimResult, device: str) -> list[tuple[str, int, float, float]]:
    """A device's compute events as (kind, micro-batch, start, end), in start order."""
    return [
        (e.kind, e.mb, e.start, e.end)
        for e in sorted(res.events, key=lambda e: (e.start, e.kind))
        if e.device == device and e.kind in ("F", "B")
    ]


def approx_timeline(
    expected: list[tuple[str, int, float, float]],
) -> list[tuple[str, int, object, object]]:
    return [(k, mb, pytest.approx(s * U), pytest.approx(e * U)) for k, mb, s, e in expected]


def check_split_rules(res: SimResult, plan: Plan, policy: str = "1f1b") -> None:
    """What the worker guarantees a splitting device: lanes, the join, order, memory."""
    m = plan.microbatches
    by_dev: dict[str, list[Event]] = defaultdict(list)
    for e in res.events:
        if e.kind in ("F", "B"):
            by_dev[e.device].append(e)
    for s, spec in enumerate(plan.stages):
        for a in spec.devices:
            evs = sorted(by_dev[a.device], key=lambda e: e.start)
            for kind in ("F", "B"):  # one task per lane at a time
                lane = [e for e in evs if e.kind == kind]
                assert [e.mb for e in lane] == list(range(m))
                for x, y in itertools.pairwise(lane):
                    assert x.end <= y.start
            for x, y in itertools.combinations(evs, 2):
                # the join: a task starts with its partner or after every earlier one ended
                assert x.start == y.start or x.end <= y.start or y.end <= x.start
                if a.forward_share is None:
                    assert x.end <= y.start or y.end <= x.start
            f_end = {e.mb: e.end for e in evs if e.kind == "F"}
            b_start = {e.mb: e.start for e in evs if e.kind == "B"}
            assert all(f_end[j] <= b_start[j] for j in range(m))
            extra = 1 if a.forward_share is not None else 0
            k = plan.warmup(s) if policy == "1f1b" else m
            assert 1 <= res.max_alive[a.device] <= min(k + extra, m)


# --- one stage ------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 4])
def test_one_device_runs_a_forward_alone_then_pairs_then_a_backward_alone(m: int) -> None:
    # One layer, one sample per micro-batch, K = 1: F0 alone on its lane [0, 3); then
    # B_j beside F_{j+1} (B_j frees its micro-batch, so F_{j+1} is within K) for 3 each;
    # the last backward alone [3m, 3m + 3). Round 3(m + 1); a device running one task
    # at a time needs 3m, so the lanes cost one step of fill here.
    cost = make_cost({"a": 1.0}, profile=make_profile(layers=1, out_bytes=0))
    plan = split(make_plan([(0, 1, {"a": 1})], m, m), {"a": THIRD})
    res = simulate(plan, cost)
    check_split_rules(res, plan)
    expected = [("F", 0, 0, 3)]
    for j in range(m):
        expected.append(("B", j, 3 * (j + 1), 3 * (j + 2)))
        if j + 1 < m:
            expected.append(("F", j + 1, 3 * (j + 1), 3 * (j + 2)))
    assert compute(res, "a") == approx_timeline(sorted(expected, key=lambda x: (x[2], x[0])))
    assert res.round_s == pytest.approx(3 * (m + 1) * U)
    assert simulate(make_plan([(0, 1, {"a": 1})], m, m), cost).round_s == 3 * m * U
    # the device's capacity is busy m x (F + B) of the round: 1 F-lane and 1 B-lane slot idle
    assert res.bubble_fraction == pytest.approx(1 / (m + 1))
    # during a pair the forward's micro-batch grows beside the backward's: K + 1
    assert res.max_alive == {"a": min(2, m)}
    assert res.peak_bytes == {"a": cost.memory(0, 1, 1, min(2, m))}


def test_a_lone_action_runs_at_its_lanes_rate() -> None:
    # beta = 1/4: the forward alone takes F / beta = 4, the backward alone B / (3/4) = 8/3
    cost = make_cost({"a": 1.0}, profile=make_profile(layers=1, out_bytes=0))
    res = simulate(split(make_plan([(0, 1, {"a": 1})], 1, 1), {"a": 0.25}), cost)
    assert compute(res, "a") == approx_timeline([("F", 0, 0, 4), ("B", 0, 4, 4 + 8 / 3)])


# --- two stages -------------------------------------------------------------------------


def test_two_splitting_stages_as_computed_by_hand() -> None:
    # a: layers [0, 4), b: [4, 8), one sample per micro-batch, free transfers, M = 3,
    # K_0 = 3, K_1 = 1. F = 4, B = 8 on each device; beta = 1/3 -> every lane L = 12.
    # a forwards 0, 1, 2 alone (no gradient yet) in [0, 3L); b forwards 0 in [L, 2L),
    # then pairs B0 with F1 [2L, 3L) and B1 with F2 [3L, 4L), then B2 alone [4L, 5L).
    # a gets gradient j at (3 + j)L and runs it alone (every forward done): round 6L.
    cost = make_cost({"a": 1.0, "b": 1.0}, profile=make_profile(out_bytes=0))
    plan = split(make_plan([(0, 4, {"a": 1}), (4, 8, {"b": 1})], 3, 3), {"a": THIRD, "b": THIRD})
    res = simulate(plan, cost)
    check_split_rules(res, plan)
    assert compute(res, "a") == approx_timeline(
        [(k, j, 12 * t, 12 * t + 12) for k, j, t in [("F", 0, 0), ("F", 1, 1), ("F", 2, 2)]]
        + [("B", j, 12 * (3 + j), 12 * (4 + j)) for j in range(3)]
    )
    assert compute(res, "b") == approx_timeline(
        [
            ("F", 0, 12, 24),
            ("B", 0, 24, 36),
            ("F", 1, 24, 36),
            ("B", 1, 36, 48),
            ("F", 2, 36, 48),
            ("B", 2, 48, 60),
        ]
    )
    assert res.round_s == pytest.approx(72 * U)
    assert res.max_alive == {"a": 3, "b": 2}


def test_the_pair_is_joined_a_forward_arriving_mid_backward_waits_for_it() -> None:
    # a (slowdown 4, one task at a time): F = 16, B = 32; b splits at 1/3: lanes of 12.
    # M = 2, K_0 = 2, K_1 = 1, free transfers. a: F0 [0, 16), F1 [16, 32). b: F0 alone
    # [16, 28); at 28 only B0 is ready (activation 1 lands at 32), so B0 runs alone on
    # its lane [28, 40): 12, not 8. F1 arrives at 32 but b decides again only when its
    # pair ended: F1 [40, 52), then B1 alone [52, 64). a: B0 [40, 72), B1 [72, 104).
    cost = make_cost({"a": 4.0, "b": 1.0}, profile=make_profile(out_bytes=0))
    plan = split(make_plan([(0, 4, {"a": 1}), (4, 8, {"b": 1})], 2, 2), {"b": THIRD})
    res = simulate(plan, cost)
    check_split_rules(res, plan)
    assert compute(res, "b") == approx_timeline(
        [("F", 0, 16, 28), ("B", 0, 28, 40), ("F", 1, 40, 52), ("B", 1, 52, 64)]
    )
    assert compute(res, "a") == approx_timeline(
        [("F", 0, 0, 16), ("F", 1, 16, 32), ("B", 0, 40, 72), ("B", 1, 72, 104)]
    )
    arrival = [e.end for e in res.events if e.kind == "recv" and e.device == "b" and e.mb == 1]
    assert arrival == [pytest.approx(32 * U)]
    assert res.round_s == pytest.approx(104 * U)


def test_outputs_leave_when_their_own_action_ends_not_when_the_pair_does() -> None:
    # b (last stage, 4 layers, one sample) splits at beta = 1/4: forward lane
    # F / beta = 16, backward lane B / (3/4) = 32/3. a: F0 [0, 4), F1 [4, 8); b: F0
    # alone [4, 20), then B0 beside F1 from 20. B0's gradient leaves at 20 + 32/3 and a
    # starts its backward then, while F1 runs on to 36; b's B1 waits for the pair.
    cost = make_cost({"a": 1.0, "b": 1.0}, profile=make_profile(out_bytes=0))
    plan = split(make_plan([(0, 4, {"a": 1}), (4, 8, {"b": 1})], 2, 2), {"b": 0.25})
    res = simulate(plan, cost)
    check_split_rules(res, plan)
    b0_end = 20 + 32 / 3
    assert compute(res, "b") == approx_timeline(
        [("F", 0, 4, 20), ("B", 0, 20, b0_end), ("F", 1, 20, 36), ("B", 1, 36, 36 + 32 / 3)]
    )
    sends = [(e.mb, e.start) for e in res.events if e.kind == "send" and e.device == "b"]
    assert sends == [(0, pytest.approx(b0_end * U)), (1, pytest.approx((36 + 32 / 3) * U))]
    assert compute(res, "a")[2] == (
        "B",
        0,
        pytest.approx(b0_end * U),
        pytest.approx((b0_end + 8) * U),
    )


# --- None is the old simulator -------------------------------------------------------


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
def test_forward_share_none_is_one_task_at_a_time_as_before(policy: str) -> None:
    # a balanced 4-stage pipeline keeps its closed form (M + S - 1) x (F + B) step
    names = [f"d{i}" for i in range(4)]
    cost = make_cost(dict.fromkeys(names, 1.0), profile=make_profile(out_bytes=0))
    plan = make_plan([(2 * i, 2 * i + 2, {names[i]: 1}) for i in range(4)], 24, 6)
    explicit = split(plan, dict.fromkeys(names, None))
    res = simulate(explicit, cost, policy)
    assert res.round_s == (6 + 4 - 1) * 2 * 4 * 3 * U
    assert res.events == simulate(plan, cost, policy).events
    check_split_rules(res, explicit, policy)


def test_only_the_splitting_device_changes_its_own_durations() -> None:
    cost = make_cost({"a": 1.0, "b": 2.0, "c": 1.0}, bandwidth=1e6)
    plan = make_plan([(0, 3, {"a": 1}), (3, 8, {"b": 1, "c": 1})], 32, 4)
    res = simulate(split(plan, {"b": 0.4}), cost)
    check_split_rules(res, split(plan, {"b": 0.4}))
    samples = {d: hi - lo for s in range(2) for d, (lo, hi) in plan.ranges(s).items()}
    for e in res.events:
        if e.kind in ("F", "B"):
            lo, hi = (0, 3) if e.device == "a" else (3, 8)
            base = cost.compute(e.device, lo, hi, samples[e.device], e.kind)
            rate = {"F": 0.4, "B": 0.6}[e.kind] if e.device == "b" else 1.0
            assert e.end - e.start == pytest.approx(base / rate)


# --- the optimal split against the even split -------------------------------------------


def random_instance(seed: int) -> tuple[Plan, CostModel]:
    """A 1-3 stage pipeline of groups of 1-2 devices on an uneven synthetic profile."""
    rng = random.Random(seed)
    layers = 8
    fwd = [rng.uniform(0.2e-3, 2e-3) for _ in range(layers)]
    prof = layered_profile(
        fwd,
        [rng.choice((0, 1024, 16 * 1024)) for _ in range(layers)],
        [1024] * layers,
        [64 * 1024] * layers,
        backward_s=[f * rng.uniform(1.2, 3.0) for f in fwd],
    )
    depth = rng.randint(1, 3)
    cuts = [0, *sorted(rng.sample(range(1, layers), depth - 1)), layers]
    stages, n = [], 0
    for lo, hi in itertools.pairwise(cuts):
        group = {f"d{n + i}": rng.randint(1, 3) for i in range(rng.randint(1, 2))}
        n += len(group)
        stages.append((lo, hi, group))
    devs = [(f"d{i}", rng.choice((1.0, 1.5, 2.5)), 1 << 30) for i in range(n)]
    cost = hetero_cost(devs, prof, bandwidth=rng.choice((1e6, 1e7, 1e9)))
    m = rng.randint(2, 8)
    return make_plan(stages, 8 * m, m), cost


def with_betas(plan: Plan, cost: CostModel, beta: float | None) -> Plan:
    """Every device split at `beta`, or at its own optimal beta when None."""
    betas: dict[str, float | None] = {}
    for s, spec in enumerate(plan.stages):
        for d, (lo, hi) in plan.ranges(s).items():
            f = cost.compute(d, spec.start, spec.end, hi - lo, "F")
            b = cost.compute(d, spec.start, spec.end, hi - lo, "B")
            betas[d] = optimal_beta(f, b) if beta is None else beta
    return split(plan, betas)


@pytest.mark.parametrize("seed", range(12))
def test_the_optimal_split_is_never_slower_than_the_even_one(seed: int) -> None:
    plan, cost = random_instance(seed)
    best = with_betas(plan, cost, None)
    half = with_betas(plan, cost, 0.5)
    res = simulate(best, cost)
    check_split_rules(res, best)
    check_split_rules(simulate(half, cost), half)
    assert res.round_s <= simulate(half, cost).round_s * (1 + 1e-9)
    assert 0.0 <= res.bubble_fraction < 1.0
    for s, spec in enumerate(plan.stages):
        for d, (lo, hi) in plan.ranges(s).items():
            assert res.peak_bytes[d] == cost.memory(spec.start, spec.end, hi - lo, res.max_alive[d])
