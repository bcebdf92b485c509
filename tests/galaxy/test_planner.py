"""Algorithm 1 on hand-computed cases, exact sums, baselines, and the gap to exhaustive search."""

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.cost import device_memory_bytes, memory_bytes, predict
from services.coordinator.galaxy.planner import (
    balanced_partition,
    capacities,
    fits,
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
    require_capacity,
    require_fit,
)

CONFIG = TransformerConfig("decoder", 2, 96, 6, 384, 4096, 64, 1e-5)
SEQ = 16
MiB = 1 << 20
BIG = 1 << 40


def _profile(name, slow=1.0, seq_len=SEQ, config=CONFIG):
    return BlockProfile(
        device=name,
        seq_len=seq_len,
        mha=((config.heads, 0.6 * slow),),
        mlp=((config.ffn, 0.9 * slow),),
        con=((seq_len, 0.01 * slow),),
    )


def _need(heads, cols, rows=8):
    return device_memory_bytes(CONFIG, SEQ, heads, cols, rows)


def test_balanced_partition_is_largest_remainder():
    assert balanced_partition(10, [1, 1, 1]) == [4, 3, 3]
    assert balanced_partition(7, [2, 1]) == [5, 2]  # quotas 4.67, 2.33
    assert balanced_partition(5, [0.1, 0.2, 0.7]) == [0, 1, 4]  # 0.5, 1.0, 3.5: tie to heavier
    assert balanced_partition(0, [1, 2]) == [0, 0]
    with pytest.raises(ConfigError, match="weights must be >= 0 with a positive sum"):
        balanced_partition(3, [0, 0])


def test_homogeneous_devices_get_even_splits():
    names = ["a", "b", "c"]
    plan = plan_galaxy(
        CONFIG, names, {n: _profile(n) for n in names}, dict.fromkeys(names, BIG), SEQ
    )
    assert (plan.heads, plan.cols, plan.rows) == ([2, 2, 2], [128, 128, 128], [6, 5, 5])
    assert plan.mode == "galaxy" and plan.overlap


def test_twice_as_fast_gets_twice_the_work():
    profiles = {"fast": _profile("fast"), "slow": _profile("slow", 2.0)}
    assert capacities(CONFIG, list(profiles.values())) == pytest.approx([1 / 1.5, 1 / 3.0])
    plan = plan_galaxy(CONFIG, ["fast", "slow"], profiles, {"fast": BIG, "slow": BIG}, SEQ)
    assert (plan.heads, plan.cols, plan.rows) == ([4, 2], [256, 128], [8, 8])


def test_oom_device_sheds_mlp_columns_to_the_free_one():
    profiles = {"a": _profile("a"), "b": _profile("b")}
    budgets = {"a": BIG, "b": _need(3, 100)}  # b can hold its 3 heads and only 100 columns
    plan = plan_galaxy(CONFIG, ["a", "b"], profiles, budgets, SEQ)
    assert (plan.heads, plan.cols) == ([3, 3], [284, 100])
    assert fits(plan, CONFIG, budgets) == []


def test_mha_is_rebalanced_when_shedding_every_column_is_not_enough():
    profiles = {"a": _profile("a"), "b": _profile("b")}
    budgets = {"a": BIG, "b": _need(1, 0)}
    plan = plan_galaxy(CONFIG, ["a", "b"], profiles, budgets, SEQ)
    assert (plan.heads, plan.cols) == ([5, 1], [384, 0])
    assert memory_bytes(plan, CONFIG)[1] <= budgets["b"]


def test_overflow_is_shared_among_free_devices_in_proportion_to_capacity():
    names = ["a", "b", "c"]
    profiles = {"a": _profile("a"), "b": _profile("b"), "c": _profile("c", 2.0)}
    budgets = {"a": BIG, "b": _need(2, 54, rows=6), "c": BIG}
    plan = plan_galaxy(CONFIG, names, profiles, budgets, SEQ)
    # V = 1 : 1 : 0.5, so 384 columns start as 154 / 153 / 77; b sheds 99 = 66 + 33
    assert plan.cols == [154 + 66, 54, 77 + 33]
    assert plan.heads == [3, 2, 1]  # 6 heads at 2.4 / 2.4 / 1.2: the tie goes to a
    assert fits(plan, CONFIG, budgets) == []


def test_impossible_budgets_fail_naming_the_device_and_shortfall():
    profiles = {"a": _profile("a"), "b": _profile("b")}
    # a is exactly full with half the model, so it has no room to take b's share
    budgets = {"a": _need(3, 192), "b": _need(0, 0) + 1000}
    with pytest.raises(PlanError) as err:
        plan_galaxy(CONFIG, ["a", "b"], profiles, budgets, SEQ)
    text = str(err.value)
    assert "galaxy plan does not fit" in text
    assert f"has {budgets['b'] // MiB} MiB" in text
    need = int(text.split("b needs ")[1].split(" MiB")[0])
    assert need * MiB > budgets["b"]


def test_a_model_no_split_can_hold_is_refused_before_profiling():
    """The capacity check agrees with the planner: it passes where a plan fits, not below."""
    whole, fixed = _need(CONFIG.heads, CONFIG.ffn, SEQ), _need(0, 0, 0)
    enough = {"a": fixed + (whole - fixed) // 2 + MiB, "b": fixed + (whole - fixed) // 2 + MiB}
    require_capacity(CONFIG, enough, SEQ)
    profiles = {"a": _profile("a"), "b": _profile("b")}
    assert fits(plan_galaxy(CONFIG, ["a", "b"], profiles, enough, SEQ), CONFIG, enough) == []
    short = {"a": fixed + (whole - fixed) // 3, "b": fixed + (whole - fixed) // 3}
    with pytest.raises(PlanError, match=r"no split fits: .* the devices have \d+ MiB above that"):
        require_capacity(CONFIG, short, SEQ)
    with pytest.raises(PlanError):
        plan_galaxy(CONFIG, ["a", "b"], profiles, short, SEQ)


@settings(max_examples=60, deadline=None)
@given(
    slowdowns=st.lists(st.floats(0.2, 5.0), min_size=1, max_size=5),
    fractions=st.lists(st.floats(0.0, 1.5), min_size=5, max_size=5),
    seq_len=st.integers(1, 64),
)
def test_sums_are_always_exact_and_a_returned_plan_fits(slowdowns, fractions, seq_len):
    names = [f"d{i}" for i in range(len(slowdowns))]
    profiles = {n: _profile(n, s, seq_len) for n, s in zip(names, slowdowns, strict=False)}
    floor = device_memory_bytes(CONFIG, seq_len, 0, 0, seq_len)
    whole = device_memory_bytes(CONFIG, seq_len, CONFIG.heads, CONFIG.ffn, seq_len) - floor
    budgets = {n: floor + int(f * whole) for n, f in zip(names, fractions, strict=False)}
    try:
        plan = plan_galaxy(CONFIG, names, profiles, budgets, seq_len)
    except PlanError as err:
        assert "MiB, has" in str(err)
        return
    plan.check(CONFIG)  # heads, cols and rows each sum to the model's totals
    assert sum(plan.heads) == CONFIG.heads and sum(plan.cols) == CONFIG.ffn
    assert sum(plan.rows) == seq_len and max(plan.rows) - min(plan.rows) <= 1
    assert fits(plan, CONFIG, budgets) == []


def test_baselines_and_their_oom_reports():
    names = ["a", "b"]
    mlm = plan_megatron(CONFIG, names, SEQ)
    assert (mlm.heads, mlm.cols, mlm.rows) == ([3, 3], [192, 192], [16, 16])
    sp = plan_sp(CONFIG, names, SEQ)
    assert (sp.heads, sp.cols, sp.rows) == ([6, 6], [384, 384], [8, 8])
    budgets = {"a": BIG, "b": _need(3, 192, rows=16)}
    assert fits(mlm, CONFIG, budgets) == []
    (msg,) = fits(sp, CONFIG, budgets)
    assert msg.startswith("b needs ") and msg.endswith(f"has {budgets['b'] // MiB} MiB")
    with pytest.raises(PlanError, match="sp plan does not fit: b needs"):
        plan_sp(CONFIG, names, SEQ, budgets)
    with pytest.raises(PlanError, match="sp plan does not fit"):
        require_fit(sp, CONFIG, budgets)
    with pytest.raises(ConfigError, match="no memory budget for devices"):
        fits(sp, CONFIG, {"a": BIG})
    with pytest.raises(ConfigError, match="one or more distinct devices"):
        plan_megatron(CONFIG, ["a", "a"], SEQ)
    with pytest.raises(ConfigError, match="seq_len must be >= 1, got 0"):
        plan_sp(CONFIG, names, 0)


def test_local_picks_the_fastest_device_that_fits():
    profiles = {"fast": _profile("fast"), "mid": _profile("mid", 1.5), "slow": _profile("slow", 3)}
    whole = device_memory_bytes(CONFIG, SEQ, CONFIG.heads, CONFIG.ffn, SEQ)
    budgets = {"fast": whole - 1, "mid": whole, "slow": BIG}
    plan = plan_local(CONFIG, list(profiles), profiles, budgets, SEQ)
    assert plan.devices == ["mid"] and plan.mode == "local"
    with pytest.raises(PlanError, match="no single device holds the model: fast needs"):
        plan_local(CONFIG, ["fast"], profiles, budgets, SEQ)


def test_planning_four_devices_is_fast():
    names = [f"d{i}" for i in range(4)]
    big = TransformerConfig("decoder", 36, 1280, 20, 5120, 50257, 1024, 1e-5)  # GPT2-L shape
    profiles = {n: _profile(n, 1 + i, 284, big) for i, n in enumerate(names)}
    budgets = dict.fromkeys(names, int(1.2 * (1 << 30)))
    start = time.perf_counter()
    plan = plan_galaxy(big, names, profiles, budgets, 284)
    assert time.perf_counter() - start < 5.0
    assert fits(plan, big, budgets) == []


# --- Algorithm 1 against exhaustive search over the same cost model -------------------

GRID = TransformerConfig("decoder", 2, 64, 8, 256, 512, 64, 1e-5)
GRID_SEQ = 32
STEP = 16  # columns move in steps of 16 in the exhaustive search


def _compositions(total, parts, step=1):
    n = total // step
    for cut in itertools.combinations(range(n + parts - 1), parts - 1):
        edges = [-1, *cut, n + parts - 1]
        yield [(edges[i + 1] - edges[i] - 1) * step for i in range(parts)]


def _case(seed, d, independent):
    """Random devices: scaled copies of one linear profile, or MHA and MLP speeds that differ."""
    rng = random.Random(seed)
    names = [f"d{i}" for i in range(d)]
    profiles = {}
    for n in names:
        sh, sm = rng.uniform(1, 4), rng.uniform(1, 4)
        oh, om = rng.uniform(0, 0.2), rng.uniform(0, 0.2)
        if not independent:
            sm, oh, om = sh, 0.0, 0.0
        profiles[n] = BlockProfile(
            device=n,
            seq_len=GRID_SEQ,
            mha=tuple((h, sh * (oh + h / GRID.heads)) for h in range(1, GRID.heads + 1)),
            mlp=tuple((c, sm * (om + c / GRID.ffn)) for c in range(STEP, GRID.ffn + 1, STEP)),
            con=((GRID_SEQ, 0.01),),
        )
    floor = device_memory_bytes(GRID, GRID_SEQ, 0, 0, GRID_SEQ // d)
    whole = device_memory_bytes(GRID, GRID_SEQ, GRID.heads, GRID.ffn, GRID_SEQ // d) - floor
    budgets = {n: int(floor + whole * rng.uniform(0.9, 1.5) / d) for n in names}
    return names, profiles, budgets


def _exhaustive(names, profiles, budgets, bps):
    rows = balanced_partition(GRID_SEQ, [1.0] * len(names))
    best = None
    for heads in _compositions(GRID.heads, len(names)):
        for cols in _compositions(GRID.ffn, len(names), STEP):
            plan = InferencePlan(
                mode="galaxy", devices=names, heads=heads, cols=cols, rows=rows, seq_len=GRID_SEQ
            )
            if not fits(plan, GRID, budgets):
                t = predict(plan, GRID, profiles, bps).total_s
                best = t if best is None else min(best, t)
    return best


# Measured over 40 seeds x D in {2, 3} x 4, 6 or 8 heads, tight and loose budgets
# (640 cases): with scaled profiles (how devices are emulated) Algorithm 1 was at most
# 8.4% slower than the best grid plan, and often faster (its columns are not restricted
# to the grid): the gap is largest-remainder rounding of few heads, which is not
# min-max optimal. With MHA and MLP speeds that differ per device (and fixed overheads)
# it was up to 1.68x slower, because Eq. 6's single capacity splits both blocks by the
# same ratio. It never failed where a grid plan fit.
BOUNDS = {False: 1.10, True: 1.75}


@pytest.mark.parametrize("independent", [False, True])
@pytest.mark.parametrize("d", [2, 3])
def test_algorithm_1_against_exhaustive_search(d, independent):
    ratios = []
    for seed in range(8):
        names, profiles, budgets = _case(seed, d, independent)
        best = _exhaustive(names, profiles, budgets, 50e6)
        try:
            plan = plan_galaxy(GRID, names, profiles, budgets, GRID_SEQ, overlap=False)
        except PlanError:
            assert best is None  # it gave up only where no grid plan fits either
            continue
        if best is None:
            continue  # it found a plan finer than the grid where no grid plan fits
        ratios.append(predict(plan, GRID, profiles, 50e6).total_s / best)
    assert ratios and max(ratios) <= BOUNDS[independent]
