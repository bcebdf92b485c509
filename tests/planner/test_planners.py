"""Planners: valid plans, memory awareness, errors, quality against the exhaustive optimum."""

import itertools
import random
import re

import pytest

from common.errors import ConfigError, PlanError
from common.plan import Plan
from services.planner._steps import comm_time, stage_time, total
from services.planner.asteroid import AsteroidPlanner
from services.planner.balance import balance
from services.planner.base import PlanDoesNotFit, check_memory, fmt_bytes
from services.planner.cost import CostModel
from services.planner.registry import PLANNERS, get_planner
from services.planner.simulator import estimate, simulate
from tests.planner.fixtures import (
    MiB,
    effnet_like_cost,
    hetero_cost,
    layered_profile,
    make_cost,
    make_plan,
    make_profile,
)

MEMORY_UNAWARE = ["dp", "gpipe", "pipedream", "dapple", "hetpipe"]
MEMORY_AWARE = ["asteroid", "duanwu", "optimal"]


def small_cost(bandwidth: float = 2e7) -> CostModel:
    """Four heterogeneous devices, six uneven layers, ample memory."""
    profile = layered_profile(
        forward_s=[2e-3, 4e-3, 3e-3, 6e-3, 1e-3, 2e-3],
        out_bytes=[64 << 10, 32 << 10, 32 << 10, 16 << 10, 8 << 10, 1 << 10],
        act_bytes=[64 << 10, 64 << 10, 32 << 10, 32 << 10, 16 << 10, 4 << 10],
        param_bytes=[64 << 10, 128 << 10, 256 << 10, 512 << 10, 512 << 10, 64 << 10],
        batch_sizes=(1, 4, 16),
        exponent=0.9,
    )
    devices = [
        ("nx", 1.0, 1 << 30),
        ("tx2", 1.7, 1 << 30),
        ("nano", 3.0, 1 << 29),
        ("pi", 5.0, 1 << 29),
    ]
    return hetero_cost(devices, profile, bandwidth=bandwidth)


def describe(plan: Plan) -> list[tuple[int, int, dict[str, int]]]:
    return [(s.start, s.end, {a.device: a.share for a in s.devices}) for s in plan.stages]


# --- every planner ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_returns_a_valid_scored_plan(name: str) -> None:
    cost = small_cost()
    plan = get_planner(name).plan(cost, 32, 4)
    plan.validate_for(cost.num_layers)
    assert plan.planner == name
    assert simulate(plan, cost).round_s > 0


# Every planner puts a lone device's whole model in one stage. Figures by hand from
# make_profile (per layer and sample 2^-10 s forward, 2^-9 s backward; 1 MiB of
# parameters and of optimizer state, 8 KiB of activations): M = 4 micro-batches of
# 8 samples on 8 layers take 4 x 8 x 8 x 3 x 2^-10 s = 0.75 s; memory is weights and
# gradients (16 MiB) plus optimizer state (8 MiB) plus K micro-batches of activations,
# 8 layers x 8 samples x 8 KiB = 512 KiB each, K = 1 under 1F1B and M under GPipe.
@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_scores_a_lone_device_as_computed_by_hand(name: str) -> None:
    cost = make_cost({"solo": 1.0})
    plan = get_planner(name).plan(cost, 32, 4)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 8)]
    assert plan.ranges(0) == {"solo": (0, 8)}
    assert plan.predicted_round_s == 0.75
    k = 4 if name == "gpipe" else 1
    assert plan.predicted_peak_bytes == {"solo": 24 * MiB + k * 512 * 1024}


def test_estimate_of_a_two_stage_plan_as_computed_by_hand() -> None:
    # a (slowdown 1) runs layers [0, 2), b (slowdown 2) layers [2, 8), 8-sample
    # micro-batches, M = 4; 4096 B per sample cross the boundary at 2^20 B/s.
    # Steps: a 2 x 8 x 3 = 48 units of 2^-10 s; boundary 2 x 8 x 4096 / 2^20 s
    # = 64 units; b 6 x 8 x 3 x 2 = 288 units. Dominant-step estimate:
    # sum + (M - 1) x max = 400 + 3 x 288 = 1264 units.
    cost = make_cost({"a": 1.0, "b": 2.0}, bandwidth=2.0**20)
    plan = make_plan([(0, 2, {"a": 8}), (2, 8, {"b": 8})], 32, 4)
    assert estimate(plan, cost) == 1264 * 2.0**-10


def test_registry_lists_the_papers_planners() -> None:
    assert set(PLANNERS) == {*MEMORY_UNAWARE, *MEMORY_AWARE}


def test_unknown_planner_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown planner 'zerobubble'.*asteroid.*pipedream"):
        get_planner("zerobubble")


def test_batch_must_divide_into_microbatches() -> None:
    with pytest.raises(PlanError, match="multiple of microbatches 3"):
        get_planner("asteroid").plan(small_cost(), 32, 3)


# --- baselines keep their papers' shapes ---------------------------------------------------


def test_gpipe_splits_layers_evenly_and_keeps_all_microbatches_in_flight() -> None:
    cost = make_cost(dict.fromkeys("abc", 1.0), profile=make_profile(layers=8))
    plan = get_planner("gpipe").plan(cost, 32, 4)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 3), (3, 6), (6, 8)]
    assert [plan.warmup(i) for i in range(3)] == [4, 4, 4]


def test_dp_splits_by_speed() -> None:
    cost = make_cost({"fast": 1.0, "slow": 3.0}, profile=make_profile(layers=4))
    plan = get_planner("dp").plan(cost, 32, 4)
    assert describe(plan) == [(0, 4, {"fast": 6, "slow": 2})]


def test_dapple_and_pipedream_use_s_minus_p_warmup() -> None:
    cost = make_cost(dict.fromkeys("abcd", 1.0), bandwidth=1e6, profile=make_profile(layers=8))
    for name in ("dapple", "pipedream"):
        plan = get_planner(name).plan(cost, 32, 8)
        n = len(plan.stages)
        assert [plan.warmup(i) for i in range(n)] == [min(n - i, 8) for i in range(n)], name


def test_hetpipe_stages_hold_one_device_per_virtual_worker_with_equal_shares() -> None:
    plan = get_planner("hetpipe").plan(effnet_like_cost(layers=24), 64, 8)
    k = len(plan.stages[0].devices)
    for s in plan.stages:
        assert len(s.devices) == k
        assert {a.share for a in s.devices} == {1}


def test_optimal_is_the_fastest_of_every_plan_simulated_one_by_one() -> None:
    # Three devices, three layers, 4-sample micro-batches: few enough plans to simulate
    # all of them here (any subset and order of devices, any layer cut, any split of
    # the samples, at least one each), so the pruned search must find their minimum.
    profile = layered_profile(
        forward_s=[3e-3, 1e-3, 2e-3],
        out_bytes=[8 << 10, 4 << 10, 1 << 10],
        act_bytes=[32 << 10] * 3,
        param_bytes=[256 << 10] * 3,
        batch_sizes=(1, 2, 4),
        exponent=0.8,
    )
    cost = hetero_cost([("x", 1.0, 1 << 30), ("y", 2.0, 1 << 30), ("z", 3.0, 1 << 30)], profile)
    plans = []
    for order in itertools.chain.from_iterable(itertools.permutations("xyz", n) for n in (1, 2, 3)):
        for cuts in itertools.product([0, 1], repeat=len(order) - 1):  # 1: new stage here
            groups: list[list[str]] = [[order[0]]]
            for d, new in zip(order[1:], cuts, strict=True):
                groups.append([d]) if new else groups[-1].append(d)
            if len(groups) > 3:
                continue
            for inner in itertools.combinations([1, 2], len(groups) - 1):
                bounds = [0, *inner, 3]
                splits = [
                    [c for c in itertools.product(range(1, 5), repeat=len(g)) if sum(c) == 4]
                    for g in groups
                ]
                for shares in itertools.product(*splits):
                    stages = [
                        (bounds[p], bounds[p + 1], dict(zip(g, sh, strict=True)))
                        for p, (g, sh) in enumerate(zip(groups, shares, strict=True))
                    ]
                    plans.append(make_plan(stages, 16, 4))
    fastest = min(simulate(p, cost).round_s for p in plans)
    best = get_planner("optimal").plan(cost, 16, 4)
    assert len(plans) > 100
    assert simulate(best, cost).round_s == fastest


def test_optimal_finds_a_split_algorithm_1_does_not() -> None:
    # Algorithm 1 gives the d1/d2 group the split with the shortest step (5:3); under
    # the backward-first scheduler 6:2 lets d0 forward micro-batch 3 earlier and the
    # round is about 12% shorter. An optimum taking its shares from `balance` missed it.
    profile = layered_profile(
        forward_s=[2**-7, 3 * 2**-9, 2**-8, 0.0064941654737151865, 1e-3],
        out_bytes=[1024] * 5,
        act_bytes=[1024] * 5,
        param_bytes=[16384] * 5,
        batch_sizes=(1, 4, 16),
        exponent=0.75,
    )
    cost = hetero_cost(
        [("d0", 1.0, 327680), ("d1", 2.0, 327680), ("d2", 3.0, 327680)],
        profile,
        bandwidth=1e7,
        links={"d0|d1": 1e6, "d0|d2": 1e6, "d1|d2": 1e6},
    )
    got = balance(cost, ["d1", "d2"], 3, 5, 8, 1)
    assert got is not None and got.counts == (5, 3)
    best = get_planner("optimal").plan(cost, 32, 4)
    assert describe(best) == [(0, 3, {"d0": 8}), (3, 5, {"d1": 6, "d2": 2})]
    five_three = make_plan([(0, 3, {"d0": 8}), (3, 5, {"d1": 5, "d2": 3})], 32, 4)
    assert simulate(best, cost).round_s < 0.9 * simulate(five_three, cost).round_s


def test_optimal_refuses_large_instances() -> None:
    with pytest.raises(ConfigError, match="at most 5 devices and 10 layers"):
        get_planner("optimal").plan(effnet_like_cost(layers=24), 64, 8)


# --- Algorithm 1 ----------------------------------------------------------------------------


def test_balance_splits_proportionally_to_speed() -> None:
    cost = make_cost({"a": 1.0, "b": 3.0}, profile=make_profile(layers=4))
    got = balance(cost, ["a", "b"], 0, 4, 16, 1)
    assert got is not None
    assert got.counts == (12, 4)
    assert got.time == cost.step("a", 0, 4, 12) == cost.step("b", 0, 4, 4)


def test_balance_offloads_from_a_device_short_of_memory() -> None:
    # 12 MiB of states (weights, gradients, optimizer) plus 4 MiB per sample
    profile = make_profile(layers=4, act_bytes=MiB, param_bytes=MiB)
    cost = hetero_cost([("fast", 1.0, 20 * MiB), ("slow", 2.0, 64 * MiB)], profile)
    free = balance(cost, ["fast", "slow"], 0, 4, 12, 1, memory=False)
    capped = balance(cost, ["fast", "slow"], 0, 4, 12, 1)
    assert free is not None and capped is not None
    assert free.counts == (8, 4)
    assert capped.counts == (2, 10)
    assert capped.time == cost.step("slow", 0, 4, 10) > free.time


def test_balance_refuses_groups_that_cannot_hold_the_range() -> None:
    profile = make_profile(layers=4, param_bytes=4 * MiB)
    cost = hetero_cost([("a", 1.0, 64 * MiB), ("tiny", 1.0, 16 * MiB)], profile)
    assert balance(cost, ["a", "tiny"], 0, 4, 8, 1) is None  # tiny cannot hold the weights
    assert balance(cost, ["a", "tiny"], 0, 1, 8, 1) is not None
    assert balance(cost, ["a", "tiny"], 0, 4, 1, 1) is None  # fewer samples than devices


# --- memory ----------------------------------------------------------------------------------


def lopsided_cost() -> CostModel:
    """A fast device with little memory beside slow roomy ones; heavy early activations."""
    profile = layered_profile(
        forward_s=[4e-3] * 8,
        out_bytes=[256 << 10] * 8,
        act_bytes=[2 * MiB, 2 * MiB, MiB, MiB, 256 << 10, 256 << 10, 64 << 10, 64 << 10],
        param_bytes=[MiB] * 8,
    )
    devices = [("fast", 1.0, 28 * MiB), ("slow-a", 3.0, 256 * MiB), ("slow-b", 3.0, 256 * MiB)]
    return hetero_cost(devices, profile, bandwidth=1e9)


@pytest.mark.parametrize("name", MEMORY_UNAWARE)
def test_memory_unaware_planners_return_plans_that_check_memory_flags(name: str) -> None:
    cost = lopsided_cost()
    plan = get_planner(name).plan(cost, 32, 4)
    over = check_memory(plan, cost)
    assert over, f"{name} was expected to overshoot: {describe(plan)}"
    assert re.fullmatch(r"device fast needs \d+\.\d MiB, has 28\.0 MiB", over[0])
    assert plan.predicted_peak_bytes["fast"] > 28 * MiB


@pytest.mark.parametrize("name", MEMORY_AWARE)
def test_memory_aware_planners_fit_where_the_others_overshoot(name: str) -> None:
    cost = lopsided_cost()
    plan = get_planner(name).plan(cost, 32, 4)
    assert check_memory(plan, cost) == []


def tight_cost() -> CostModel:
    """Two 9 MiB devices, two layers of 3 MiB states and 1 MiB activations per sample.

    Together they hold the model and a micro-batch, yet every plan overshoots:
    one stage keeps both layers on each device (6 + 2 x 2 samples = 10 MiB) and
    two stages keep 3 micro-batches alive in the first (3 + 4 x 3 = 15 MiB).
    """
    profile = layered_profile(
        forward_s=[1e-3, 1e-3], out_bytes=[1024] * 2, act_bytes=[MiB] * 2, param_bytes=[MiB] * 2
    )
    return hetero_cost([("nano-1", 1.0, 9 * MiB), ("nano-2", 1.0, 9 * MiB)], profile)


@pytest.mark.parametrize("name", MEMORY_AWARE)
def test_tight_instance_raises_plan_does_not_fit_naming_device_and_shortfall(name: str) -> None:
    with pytest.raises(PlanDoesNotFit) as info:
        get_planner(name).plan(tight_cost(), 16, 4)
    if name == "asteroid":
        assert re.search(
            r"device nano-\d needs \d+\.\d MiB, has 9\.0 MiB \(short by \d+\.\d MiB\)",
            str(info.value),
        )
        assert info.value.violations


@pytest.mark.parametrize("name", MEMORY_AWARE)
def test_model_that_fits_nowhere_is_a_plan_error_saying_why(name: str) -> None:
    big = layered_profile(
        forward_s=[1e-3] * 4, out_bytes=[1024] * 4, act_bytes=[MiB] * 4, param_bytes=[4 * MiB] * 4
    )
    cost = hetero_cost([("a", 1.0, 20 * MiB), ("b", 1.0, 20 * MiB)], big)
    with pytest.raises(PlanError, match=r"fits nowhere: it needs at least 64\.0 MiB") as info:
        get_planner(name).plan(cost, 16, 4)
    assert not isinstance(info.value, PlanDoesNotFit)
    huge = layered_profile(forward_s=[1e-3], out_bytes=[1], act_bytes=[1], param_bytes=[8 * MiB])
    cost = hetero_cost([("a", 1.0, 20 * MiB), ("b", 1.0, 20 * MiB)], huge)
    with pytest.raises(PlanError, match=r"layer 0 alone needs 24\.0 MiB.*largest device a has"):
        get_planner(name).plan(cost, 16, 4)


def test_fmt_bytes_matches_the_style_of_error_messages() -> None:
    assert fmt_bytes(3.1 * (1 << 30)) == "3.1 GiB"
    assert fmt_bytes(1.5 * (1 << 30)) == "1.5 GiB"
    assert fmt_bytes(9 * MiB) == "9.0 MiB"


# --- quality -------------------------------------------------------------------------------


def test_asteroid_beats_data_and_pipeline_parallelism_on_slow_heterogeneous_links() -> None:
    cost = effnet_like_cost(layers=24, seed=3)
    rounds = {
        n: simulate(get_planner(n).plan(cost, 64, 8), cost).round_s
        for n in ("asteroid", "dp", "gpipe")
    }
    assert rounds["asteroid"] < 0.8 * rounds["dp"]
    assert rounds["asteroid"] < 0.8 * rounds["gpipe"]


def small_instance(seed: int) -> CostModel:
    """3-4 devices, 4-6 layers, random speeds, memory budgets and link bandwidths.

    Drawn from a seeded `random.Random`, so the instance set is fixed whatever
    else the test run imports (hypothesis draws from constants found in loaded
    modules, which made its instances change with unrelated code).
    """
    rng = random.Random(seed)
    layers = rng.randint(4, 6)

    def kib() -> int:
        return rng.randint(1, 64) << 10

    profile = layered_profile(
        forward_s=[rng.uniform(1e-3, 1e-2) for _ in range(layers)],
        out_bytes=[kib() for _ in range(layers)],
        act_bytes=[kib() for _ in range(layers)],
        param_bytes=[16 * kib() for _ in range(layers)],
        batch_sizes=(1, 4, 16),
        exponent=rng.uniform(0.7, 1.0),
    )
    model = 4 * sum(lp.param_bytes for lp in profile.layers)  # states x 1.33: budgets bind
    n = rng.randint(3, 4)
    devices = [
        (f"d{i}", rng.uniform(1.0, 4.0), int(model * rng.uniform(0.3, 1.5))) for i in range(n)
    ]
    links = {f"d{i}|d{j}": rng.uniform(1e6, 1e8) for i in range(n) for j in range(i + 1, n)}
    return hetero_cost(devices, profile, bandwidth=1e7, links=links)


SWEEP = 60


def test_asteroid_is_within_5_percent_of_the_exhaustive_optimum() -> None:
    """Asteroid against `optimal` (every group order, layer cut and integer split).

    The simulator that scores both is pinned by hand-computed closed forms
    (tests/planner/test_simulator.py). Every instance of this sweep is within
    5 % (worst 1.9 %). Not every instance of the family is: over seeds 0-299,
    3 of the 298 that fit are beyond it (seeds 128, 145, 247; worst 6.4 %),
    where the backward-first scheduler rewards a split that Algorithm 1's step
    balance never picks and the polish's one-sample moves do not reach.
    """
    ratios: dict[int, float] = {}
    for seed in range(SWEEP):
        cost = small_instance(seed)
        try:
            best = get_planner("optimal").plan(cost, 32, 4)
        except PlanError:
            with pytest.raises(PlanError):
                get_planner("asteroid").plan(cost, 32, 4)
            continue
        plan = get_planner("asteroid").plan(cost, 32, 4)
        assert check_memory(plan, cost) == [], seed
        ratios[seed] = simulate(plan, cost).round_s / simulate(best, cost).round_s
    assert len(ratios) >= SWEEP // 2, "most instances must fit somewhere"
    assert min(ratios.values()) >= 1 - 1e-9, "optimal must never lose to asteroid"
    far = {seed: round(r, 3) for seed, r in ratios.items() if r > 1.05}
    assert not far, f"asteroid more than 5 % above the optimum (seed: ratio): {far}"


# --- size -----------------------------------------------------------------------------------


def test_asteroid_plans_an_efficientnet_sized_model_on_six_devices() -> None:
    # Timing lives in tests/bench/bench_planner.py; this only proves it completes.
    cost = effnet_like_cost(layers=200)
    plan = AsteroidPlanner().plan(cost, 64, 8)
    plan.validate_for(200)
    assert check_memory(plan, cost) == []


def test_search_pieces_add_up_to_the_simulators_estimate() -> None:
    # The search loops score partial plans from these pieces; a complete plan must
    # get exactly the figure `estimate` gives it (uneven groups: several routes).
    cost = small_cost(bandwidth=3e6)
    plan = make_plan([(0, 2, {"nx": 5, "pi": 3}), (2, 6, {"tx2": 3, "nano": 1})], 32, 4)
    (a, ca), (b, cb) = [(["nx", "pi"], [5, 3]), (["tx2", "nano"], [6, 2])]
    assert [hi - lo for lo, hi in plan.ranges(1).values()] == cb
    steps = [
        stage_time(cost, a, ca, 0, 2),
        comm_time(cost, 2, a, ca, b, cb),
        stage_time(cost, b, cb, 2, 6),
    ]
    reduce = max(cost.allreduce(a, 0, 2), cost.allreduce(b, 2, 6))
    assert total(sum(steps), max(steps), reduce, 4) == pytest.approx(estimate(plan, cost))
