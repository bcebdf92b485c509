"""Duan & Wu's planner: the beta split, Algorithm 1 against brute force, Algorithm 2, the plans.

References are computed the plain way in each test: every contiguous partition or
every grouping enumerated, stage times summed from `CostModel.compute`, memory from
`CostModel.memory`, and figures by hand where the instance is small enough.
"""

from __future__ import annotations

import itertools
import random

import pytest

from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from services.planner.base import stage
from services.planner.cost import CostModel
from services.planner.duanwu import (
    BETA_RANGE,
    SPLIT_MARGIN,
    DuanWuPlanner,
    StageTerms,
    algorithm1,
    algorithm2,
    brute_force_grouping,
    clip_beta,
    concurrent_round,
    initial_grouping,
    optimal_beta,
    split_cost,
    split_peaks,
    split_reasons,
    split_specs,
    split_time,
)
from services.planner.duanwu_split import split_devices
from services.planner.registry import get_planner
from services.planner.simulator import simulate
from tests.planner.fixtures import MiB, hetero_cost, layered_profile


def measured(prof: Profile, gain: float | None) -> Profile:
    """`prof` as measured on a device where the split gained `gain` (None: not measured)."""
    return prof.model_copy(update={"split_gain": gain})


F = 2.0**-10  # forward seconds per layer and sample; backward is 2F (layered_profile)


# --- the beta split -------------------------------------------------------------------


def test_optimal_beta_balances_forward_and_backward_as_computed_by_hand() -> None:
    # F = 1, B = 2: beta = 1/3, forward 1 / (1/3) = 3 = backward 2 / (2/3)
    assert optimal_beta(1.0, 2.0) == pytest.approx(1 / 3)
    assert split_time(1.0, 2.0, 1 / 3) == pytest.approx(3.0)
    assert split_time(1.0, 2.0, 0.5) == pytest.approx(4.0)  # the paper's default 50 %
    assert optimal_beta(3.0, 1.0) == pytest.approx(0.75)
    assert optimal_beta(0.0, 0.0) == 0.5
    with pytest.raises(ValueError, match="must be >= 0"):
        optimal_beta(-1.0, 1.0)


@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (0.3, 0.9), (2.0, 1.0), (1e-3, 5e-3)])
def test_no_other_split_on_a_fine_grid_is_faster(fwd: float, bwd: float) -> None:
    best = split_time(fwd, bwd, optimal_beta(fwd, bwd))
    grid = min(split_time(fwd, bwd, i / 10_000) for i in range(1, 10_000))
    assert best == pytest.approx(fwd + bwd)
    assert best <= grid
    assert grid == pytest.approx(best, rel=1e-3)


def test_concurrent_round_matches_the_lane_timeline_by_hand() -> None:
    # one device, F = 1 ms-ish units (2^-10 s), B = 2F, M = 2 micro-batches of 1 sample
    cost = hetero_cost([("a", 1.0, 1 << 30)], layered_profile([F], [0], [8], [8]))
    plan = get_planner("duanwu").plan(cost, 2, 2)
    # optimal: F0 [0,3F] F1 [3F,6F], B0 [3F,6F] B1 [6F,9F]
    assert concurrent_round(plan, cost) == pytest.approx(9 * F)
    # beta = 1/2: F0 [0,2F] F1 [2F,4F], B0 [2F,6F] B1 [6F,10F]
    assert concurrent_round(plan, cost, beta=0.5) == pytest.approx(10 * F)


@pytest.mark.parametrize(("stages", "m"), [(2, 4), (3, 5), (4, 8)])
def test_concurrent_round_of_equal_stages_is_m_plus_2s_minus_1_slots(stages: int, m: int) -> None:
    devs = [(f"d{i}", 1.0, 1 << 30) for i in range(stages)]
    cost = hetero_cost(
        devs, layered_profile([F] * stages, [0] * stages, [8] * stages, [8] * stages)
    )
    plan = get_planner("duanwu").plan(cost, m, m)
    assert len(plan.stages) == stages
    assert concurrent_round(plan, cost) == pytest.approx((m + 2 * stages - 1) * 3 * F)


# --- Algorithm 1 ------------------------------------------------------------------------


def brute_partition(cost: CostModel, devs: list[str], micro: int, m: int) -> float:
    """Best bound over every contiguous split into one stage per (single) device, plainly."""
    q, layers = len(devs), cost.num_layers
    best = float("inf")
    for inner in itertools.combinations(range(1, layers), q - 1):
        cuts = [0, *inner, layers]
        worst = 0.0
        for p, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            d = devs[p]
            k = max(1, min(2 * (q - p) - 1, m))
            if cost.memory(lo, hi, micro, k) > cost.cluster.device(d).memory_bytes:
                worst = float("inf")
                break
            step = cost.compute(d, lo, hi, micro, "F") + cost.compute(d, lo, hi, micro, "B")
            worst = max(worst, step)
            if hi < layers:
                nbytes = cost.boundary_bytes(hi, micro)
                nxt = devs[p + 1]
                worst = max(worst, cost.transfer(d, nxt, nbytes), cost.transfer(nxt, d, nbytes))
        best = min(best, worst)
    return best


def random_cost(rng: random.Random, layers: int, devices: int, tight: bool) -> CostModel:
    fwd = [rng.uniform(0.2e-3, 3e-3) for _ in range(layers)]
    bwd = [f * rng.uniform(1.2, 3.0) for f in fwd]
    out = [rng.choice((1, 8, 64, 512)) * 1024 for _ in range(layers)]
    params = [rng.randint(1, 16) * 64 * 1024 for _ in range(layers)]
    prof = layered_profile(fwd, out, [1024] * len(fwd), params, backward_s=bwd)
    mem = (lambda: rng.randint(2, 6) * MiB) if tight else (lambda: 1 << 30)
    devs = [(f"d{i}", rng.choice((1.0, 1.5, 2.5)), mem()) for i in range(devices)]
    return hetero_cost(devs, prof, bandwidth=rng.choice((1e6, 1e7, 1e9)))


@pytest.mark.parametrize("seed", range(30))
def test_algorithm1_bound_equals_brute_force_over_contiguous_partitions(seed: int) -> None:
    rng = random.Random(seed)
    cost = random_cost(
        rng, layers=rng.randint(3, 8), devices=rng.randint(1, 4), tight=seed % 2 == 1
    )
    devs = [d.name for d in cost.cluster.devices][: cost.num_layers]
    micro, m = 4, 4
    got = algorithm1(StageTerms(cost, tuple((d,) for d in devs), micro, m))
    want = brute_partition(cost, devs, micro, m)
    if want == float("inf"):
        assert got is None
        return
    assert got is not None
    assert got.bound == pytest.approx(want, rel=1e-6)
    assert len(got.cuts) == len(devs) + 1
    assert got.cuts[0] == 0
    assert got.cuts[-1] == cost.num_layers


def test_slow_links_move_the_cut_away_from_a_heavy_boundary() -> None:
    # 4 equal layers on two equal devices, 1 sample per micro-batch: each layer takes
    # F + 2F = 3F. Fast links: cut at 2, bound 6F. On 10 MB/s the boundary after layer 1
    # carries 100 kB = 10 ms > 9F (8.8 ms); cutting at 3 costs 9F and sends 1 kB (0.1 ms).
    prof = layered_profile([F] * 4, [1000, 100_000, 1000, 0], [8] * 4, [8] * 4)
    groups = (("a",), ("b",))
    fast = hetero_cost([("a", 1.0, 1 << 30), ("b", 1.0, 1 << 30)], prof, bandwidth=1e12)
    got = algorithm1(StageTerms(fast, groups, 1, 4))
    assert got is not None
    assert (got.cuts, got.bound) == ((0, 2, 4), pytest.approx(6 * F))
    slow = hetero_cost([("a", 1.0, 1 << 30), ("b", 1.0, 1 << 30)], prof, bandwidth=1e7)
    got = algorithm1(StageTerms(slow, groups, 1, 4))
    assert got is not None
    assert got.cuts == (0, 3, 4)
    assert got.bound == pytest.approx(9 * F)
    assert 100_000 / 1e7 > 9 * F > 1000 / 1e7


def test_memory_excludes_the_balanced_partition() -> None:
    # a (stage 0, K = 3) has room for exactly one layer, so the balanced cut at 2 is out
    prof = layered_profile([F] * 4, [0] * 4, [1024] * 4, [4096] * 4)
    roomy = hetero_cost([("a", 1.0, 1 << 30), ("b", 1.0, 1 << 30)], prof)
    room = roomy.memory(0, 1, 2, 3)
    assert roomy.memory(0, 2, 2, 3) > room
    cost = hetero_cost([("a", 1.0, room), ("b", 1.0, 1 << 30)], prof)
    got = algorithm1(StageTerms(cost, (("a",), ("b",)), 2, 4))
    assert got is not None
    assert got.cuts == (0, 1, 4)
    assert got.bound == pytest.approx(3 * 3 * 2 * F)  # 3 layers, F + 2F, 2 samples
    none = hetero_cost([("a", 1.0, room - 1), ("b", 1.0, 1 << 30)], prof)
    assert algorithm1(StageTerms(none, (("a",), ("b",)), 2, 4)) is None


def test_where_the_paper_greedy_misses_the_frontier_search_finds_the_partition() -> None:
    # three stages over 4 layers; the middle device holds only the light layer 1, so the
    # greedy's longest first stage [0, 2) strands it; the only fit is [0,1)|[1,2)|[2,4)
    prof = layered_profile([F] * 4, [0] * 4, [64] * 4, [1024, 1024, 64 * 1024, 64 * 1024])
    roomy = hetero_cost([("x", 1.0, 1 << 30)], prof)
    tiny = roomy.memory(1, 2, 1, 3)
    assert roomy.memory(2, 3, 1, 3) > tiny
    cost = hetero_cost([("a", 1.0, 1 << 30), ("t", 1.0, tiny), ("c", 1.0, 1 << 30)], prof)
    got = algorithm1(StageTerms(cost, (("a",), ("t",), ("c",)), 1, 8))
    assert got is not None
    assert got.cuts == (0, 1, 2, 4)
    assert not got.greedy
    assert got.bound == pytest.approx(brute_partition(cost, ["a", "t", "c"], 1, 8))


# --- Algorithm 2 ------------------------------------------------------------------------


def test_initial_grouping_gives_the_slowest_group_the_fastest_free_device() -> None:
    # whole-model times 1, 2, 4, 4 units. Both groups empty (ties: the later stage):
    # group 1 takes f1 (1); group 0 takes f2 (2); group 0 is slower (2 > 1) and takes
    # s4a: 1 / (1/2 + 1/4) = 4/3; still slower than 1, so it takes s4b too: 1.
    prof = layered_profile([F] * 2, [0] * 2, [8] * 2, [8] * 2)
    speeds = [("f1", 1.0), ("f2", 2.0), ("s4a", 4.0), ("s4b", 4.0)]
    cost = hetero_cost([(n, s, 1 << 30) for n, s in speeds], prof)
    got = initial_grouping(cost, ["s4a", "f1", "s4b", "f2"], 2, 4)
    assert got == [["f2", "s4a", "s4b"], ["f1"]]


def grouped_cost(seed: int, devices: int, layers: int) -> CostModel:
    rng = random.Random(seed)
    fwd = [rng.uniform(0.2e-3, 3e-3) for _ in range(layers)]
    bwd = [f * rng.uniform(1.2, 3.0) for f in fwd]
    prof = layered_profile(
        fwd, [4096] * layers, [1024] * layers, [64 * 1024] * layers, backward_s=bwd
    )
    kinds = [1.0, 1.7, 3.5]  # three device types, as in the paper's Fig. 7
    devs = [(f"d{i}", rng.choice(kinds), 1 << 30) for i in range(devices)]
    return hetero_cost(devs, prof, bandwidth=1e9)


@pytest.mark.parametrize("seed", range(12))
def test_algorithm2_is_never_worse_than_its_start_nor_better_than_brute_force(seed: int) -> None:
    cost = grouped_cost(seed, devices=5, layers=8)
    devs = [d.name for d in cost.cluster.devices]
    q, micro, m = 2 + seed % 3, 8, 4
    start = initial_grouping(cost, devs, q, micro)
    first = algorithm1(StageTerms(cost, tuple(tuple(sorted(g)) for g in start), micro, m))
    got = algorithm2(cost, devs, q, micro, m)
    brute = brute_force_grouping(cost, devs, q, micro, m)
    assert first is not None and got is not None and brute is not None
    assert got.partition.bound <= first.bound
    assert brute.partition.bound <= got.partition.bound * (1 + 1e-6)
    assert sorted(d for g in got.partition.groups for d in g) == sorted(devs)


@pytest.mark.parametrize(
    ("seed", "devices", "q"), [(0, 3, 2), (1, 4, 2), (2, 4, 3), (4, 5, 2), (7, 5, 3)]
)
def test_algorithm2_equals_brute_force_on_small_instances(seed: int, devices: int, q: int) -> None:
    cost = grouped_cost(seed, devices, layers=6)
    devs = [d.name for d in cost.cluster.devices]
    got = algorithm2(cost, devs, q, 8, 4)
    brute = brute_force_grouping(cost, devs, q, 8, 4)
    assert got is not None and brute is not None
    assert got.partition.bound == pytest.approx(brute.partition.bound, rel=1e-6)
    # the reference: every ordered grouping's Algorithm 1 bound, enumerated here
    labels = itertools.product(range(q), repeat=devices)
    groupings = [
        tuple(tuple(d for d, lab in zip(devs, ls, strict=True) if lab == g) for g in range(q))
        for ls in labels
        if len(set(ls)) == q
    ]
    bounds = [algorithm1(StageTerms(cost, g, 8, 4)) for g in groupings]
    assert brute.partition.bound == min(b.bound for b in bounds if b is not None)


# --- the planner -------------------------------------------------------------------------


def test_get_planner_returns_the_full_duanwu_planner() -> None:
    assert isinstance(get_planner("duanwu"), DuanWuPlanner)


@pytest.mark.parametrize("seed", range(6))
def test_plans_validate_use_each_device_once_and_report_betas(seed: int) -> None:
    cost = random_cost(random.Random(100 + seed), layers=8, devices=4, tight=False)
    plan = get_planner("duanwu").plan(cost, 32, 4)
    plan.validate_for(cost.num_layers)
    assert len(plan.devices) == len(set(plan.devices))
    assert plan.planner == "duanwu"
    assert simulate(plan, cost).round_s > 0
    betas = DuanWuPlanner.betas(cost, plan)
    assert set(betas) == set(plan.devices)
    for s, spec in enumerate(plan.stages):
        for d, (lo, hi) in plan.ranges(s).items():
            f = sum(cost.profile(d).time(i, hi - lo, "F") for i in range(spec.start, spec.end))
            b = sum(cost.profile(d).time(i, hi - lo, "B") for i in range(spec.start, spec.end))
            assert betas[d] == pytest.approx(f / (f + b))
            assert 0.0 < betas[d] < 0.5  # backward is slower in every layer here


def test_the_planner_falls_back_to_a_plan_whose_backups_fit() -> None:
    # two devices, two layers: the pipeline's stage 0 needs 74 bytes with its peer's
    # replica (tests/planner/test_backup_memory.py); at 70 only the one-stage plan fits
    prof = layered_profile([F] * 2, [0, 0], [2, 2], [10, 10])
    cost = hetero_cost([("a", 1.0, 70), ("b", 1.0, 70)], prof, bandwidth=100.0)
    plan = get_planner("duanwu").plan(cost, 16, 4)
    assert [(s.start, s.end, len(s.devices)) for s in plan.stages] == [(0, 2, 2)]
    assert plan.predicted_peak_bytes == {"a": 68, "b": 68}


def _with_shares(plan: Plan, shares: dict[str, float | None]) -> Plan:
    stages = [
        spec.model_copy(
            update={
                "devices": [
                    a.model_copy(update={"forward_share": shares[a.device]}) for a in spec.devices
                ]
            }
        )
        for spec in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_splits_by_the_clipped_beta_only_where_the_simulator_says_it_pays(
    seed: int,
) -> None:
    cost = random_cost(random.Random(200 + seed), layers=8, devices=4, tight=False)
    plan = get_planner("duanwu").plan(cost, 32, 4)
    plan.validate_for(cost.num_layers)
    assert Plan.model_validate(plan.model_dump()) == plan
    clipped = {d: clip_beta(b) for d, b in DuanWuPlanner.betas(cost, plan).items()}
    shares = {a.device: a.forward_share for s in plan.stages for a in s.devices}
    split = any(v is not None for v in shares.values())
    assert shares == (clipped if split else dict.fromkeys(clipped))
    # the prediction is the simulator's round of the plan as the workers run it
    res = simulate(plan, cost)
    assert plan.predicted_round_s == res.round_s
    assert 0.0 <= plan.predicted_comm_s < res.round_s
    other = _with_shares(plan, dict.fromkeys(clipped) if split else dict(clipped))
    assert res.round_s <= simulate(other, cost).round_s
    # a splitting device keeps one micro-batch more than K_p while its pair overlaps
    for s, spec in enumerate(plan.stages):
        k = min(plan.warmup(s) + split, plan.microbatches)
        for d, (lo, hi) in plan.ranges(s).items():
            need = cost.memory(spec.start, spec.end, hi - lo, k) + cost.reserved(plan)[d]
            assert plan.predicted_peak_bytes[d] == need
            assert res.max_alive[d] <= k


def test_beta_is_clipped_into_its_open_interval() -> None:
    # backward 39 times the forward: beta = 1/40, below the 0.05 floor
    prof = layered_profile([F] * 2, [0, 0], [8, 8], [8, 8], backward_s=[39 * F] * 2)
    cost = hetero_cost([("a", 1.0, 1 << 30)], measured(prof, 0.1))
    plan = get_planner("duanwu").plan(cost, 4, 2)
    assert DuanWuPlanner.betas(cost, plan)["a"] == pytest.approx(1 / 40)
    (spec,) = split_specs(cost, plan)
    assert spec.devices[0].forward_share == BETA_RANGE[0] == clip_beta(1 / 40)
    assert clip_beta(0.99) == BETA_RANGE[1]
    assert clip_beta(0.3) == 0.3


def test_a_device_without_room_for_the_overlaps_micro_batch_runs_one_task_at_a_time() -> None:
    # tests/planner/test_backup_memory.py's pipeline at 74 bytes: the first device holds
    # K = 3 micro-batches of 4 samples on [0, 1) (30 + 2 x 4 x 3 = 54) and the other's
    # 20-byte replica: 74, full; a fourth micro-batch would take 82. The second (K = 1,
    # 38 bytes and the first's replica) has room for its second: 38 + 8 + 20 = 66.
    prof = layered_profile([F] * 2, [0, 0], [2, 2], [10, 10])
    cost = hetero_cost([("a", 1.0, 74), ("b", 1.0, 74)], measured(prof, 0.1), bandwidth=100.0)
    plan = get_planner("duanwu").plan(cost, 16, 4)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 1), (1, 2)]
    plan = plan.model_copy(update={"stages": split_specs(cost, plan)})
    first, second = (s.devices[0] for s in plan.stages)
    assert first.forward_share is None
    assert second.forward_share == clip_beta(DuanWuPlanner.betas(cost, plan)[second.device])
    assert split_peaks(cost, plan) == {first.device: 74, second.device: 66}
    assert simulate(plan, cost).max_alive == {first.device: 3, second.device: 2}


def _two_device_cost(gains: dict[str, float | None]) -> CostModel:
    """Two devices of one speed, each with its own profile carrying its measured split gain."""
    prof = layered_profile([F] * 4, [0] * 4, [8] * 4, [8] * 4, backward_s=[2 * F] * 4)
    cluster = ClusterSpec(
        devices=[DeviceSpec(name=d, memory_bytes=1 << 30, profile=d) for d in gains],
        bandwidth=12.5e6,
    )
    return CostModel({d: measured(prof, g) for d, g in gains.items()}, cluster)


def _two_stage_plan(cost: CostModel) -> Plan:
    part = algorithm1(StageTerms(cost, (("a",), ("b",)), 4, 4))
    assert part is not None
    stages = [stage(lo, hi, [d], [1]) for (lo, hi), d in zip(part.ranges, "ab", strict=True)]
    return Plan(stages=stages, global_batch=16, microbatches=4)


@pytest.mark.parametrize("gain", [None, -0.2, 0.0, SPLIT_MARGIN])
def test_a_device_whose_measured_pair_is_no_faster_is_not_split(gain: float | None) -> None:
    cost = _two_device_cost({"a": 0.3, "b": gain})
    plan = _two_stage_plan(cost)
    why = split_reasons(cost, plan)
    assert why["a"] is None
    assert why["b"] is not None
    assert ("not measured" if gain is None else f"{gain:+.1%}") in why["b"]
    shares = split_devices(plan.model_copy(update={"stages": split_specs(cost, plan)}))
    assert shares["b"] is None
    assert shares["a"] == clip_beta(DuanWuPlanner.betas(cost, plan)["a"])


def test_a_device_with_a_measured_gain_is_split_with_the_models_beta() -> None:
    cost = _two_device_cost({"a": 0.15, "b": SPLIT_MARGIN + 0.01})
    plan = _two_stage_plan(cost)
    assert split_reasons(cost, plan) == {"a": None, "b": None}
    split = plan.model_copy(update={"stages": split_specs(cost, plan)})
    betas = DuanWuPlanner.betas(cost, plan)
    for d, share in split_devices(split).items():
        f = sum(
            cost.compute(d, s.start, s.end, 4, "F") for s in plan.stages if s.devices[0].device == d
        )
        b = sum(
            cost.compute(d, s.start, s.end, 4, "B") for s in plan.stages if s.devices[0].device == d
        )
        assert share == clip_beta(betas[d]) == pytest.approx(f / (f + b))
        assert share == pytest.approx(1 / 3)  # backward twice the forward: F / (F + 2F)


def test_the_simulator_scores_a_splitting_device_at_its_measured_speed() -> None:
    cost = _two_device_cost({"a": 1.0, "b": None})
    plan = _two_stage_plan(cost)
    assert split_cost(cost, plan) is cost  # nothing splits: nothing to rescore
    split = plan.model_copy(update={"stages": split_specs(cost, plan)})
    scored = split_cost(cost, split)
    slow = {d.name: d.slowdown for d in scored.cluster.devices}
    assert slow == {"a": 0.5, "b": 1.0}  # "a" gained 100 %: a pair in half the time
    assert scored.compute("a", 0, 2, 4, "F") == pytest.approx(cost.compute("a", 0, 2, 4, "F") / 2)


@pytest.mark.parametrize(("gain", "splits"), [(None, False), (0.01, False), (1.0, True)])
def test_the_planner_splits_where_the_measured_gain_shortens_the_round(
    gain: float | None, splits: bool
) -> None:
    unsplit = get_planner("duanwu").plan(_two_device_cost({"a": None, "b": None}), 16, 4)
    plan = get_planner("duanwu").plan(_two_device_cost({"a": gain, "b": gain}), 16, 4)
    shares = list(split_devices(plan).values())
    assert shares == ([pytest.approx(1 / 3)] * 2 if splits else [None, None])
    assert plan.predicted_round_s is not None and unsplit.predicted_round_s is not None
    if splits:
        assert plan.predicted_round_s < unsplit.predicted_round_s
    else:
        assert plan.predicted_round_s == unsplit.predicted_round_s
