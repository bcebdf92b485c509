"""Choosing mode and devices: the fastest predicted plan that fits, never slower than one device."""

import random

import pytest

from common.errors import ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.choose import Link, choose, rings
from services.coordinator.galaxy.cost import device_memory_bytes, predict
from services.coordinator.galaxy.planner import plan_local

CONFIG = TransformerConfig("encoder", 2, 64, 4, 256, 100, 64, 1e-12)
SEQ = 16
ROOMY = 1 << 30


def _profile(name, slow=1.0, step_s=0.0):
    # linear in the share: 0.1 s per head, 0.8 s for all columns, 0.02 s for 16 rows
    return BlockProfile(
        device=name,
        seq_len=SEQ,
        mha=((4, 0.4 * slow),),
        mlp=((256, 0.8 * slow),),
        con=((16, 0.02 * slow),),
        step_s=step_s,
    )


def _profiles(*slows):
    return {f"d{i}": _profile(f"d{i}", s) for i, s in enumerate(slows)}


def test_a_slow_link_keeps_the_model_on_the_fastest_device():
    profiles = _profiles(2.0, 1.0, 1.5)
    budgets = dict.fromkeys(profiles, ROOMY)
    got = choose(CONFIG, list(profiles), profiles, budgets, SEQ, Link(1e3))
    assert got.plan.mode == "local" and got.plan.devices == ["d1"]


def test_a_fast_link_splits_over_the_devices():
    profiles = _profiles(1.0, 1.0, 1.0)
    budgets = dict.fromkeys(profiles, ROOMY)
    got = choose(CONFIG, list(profiles), profiles, budgets, SEQ, Link(1e12))
    assert len(got.plan.devices) == 3 and got.plan.mode != "local"
    alone = predict(plan_local(CONFIG, ["d0"], profiles, budgets, SEQ), CONFIG, profiles, 1e12)
    assert got.predicted_s < alone.total_s


def test_a_large_fixed_step_cost_keeps_the_model_on_one_device():
    profiles = _profiles(1.0, 1.0)
    budgets = dict.fromkeys(profiles, ROOMY)
    assert len(choose(CONFIG, ["d0", "d1"], profiles, budgets, SEQ, Link(1e12)).plan.devices) == 2
    slow_steps = Link(1e12, step_latency_s=0.5)
    assert choose(CONFIG, ["d0", "d1"], profiles, budgets, SEQ, slow_steps).plan.mode == "local"


def test_a_model_no_single_device_holds_is_split():
    profiles = _profiles(1.0, 1.0, 1.0)
    whole = device_memory_bytes(CONFIG, SEQ, CONFIG.heads, CONFIG.ffn, SEQ)
    budgets = dict.fromkeys(profiles, int(whole * 0.8))
    got = choose(CONFIG, list(profiles), profiles, budgets, SEQ, Link(1e3))
    assert len(got.plan.devices) >= 2 and got.plan.mode in ("galaxy", "megatron")
    with pytest.raises(PlanError, match="no single device holds"):
        plan_local(CONFIG, list(profiles), profiles, budgets, SEQ)


def test_nothing_fits_is_refused_naming_the_budgets():
    profiles = _profiles(1.0, 1.0)
    with pytest.raises(PlanError, match=r"d0 0 MiB, d1 0 MiB"):
        choose(CONFIG, ["d0", "d1"], profiles, dict.fromkeys(profiles, 1000), SEQ, Link(1e9))


def test_a_device_without_a_profile_or_budget_is_refused():
    profiles = _profiles(1.0)
    with pytest.raises(ConfigError, match="missing for"):
        choose(CONFIG, ["d0", "x"], profiles, {"d0": ROOMY}, SEQ, Link(1e9))
    with pytest.raises(ConfigError, match="at least one device"):
        choose(CONFIG, [], profiles, {}, SEQ, Link(1e9))


@pytest.mark.parametrize("seed", range(12))
def test_never_predicted_slower_than_the_best_single_device_that_fits(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    profiles = {f"d{i}": _profile(f"d{i}", rng.uniform(0.5, 8.0)) for i in range(n)}
    whole = device_memory_bytes(CONFIG, SEQ, CONFIG.heads, CONFIG.ffn, SEQ)
    budgets = {d: int(whole * rng.uniform(0.6, 2.0)) for d in profiles}
    link = Link(10 ** rng.uniform(4, 10), step_latency_s=rng.choice([0.0, 0.001, 0.05]))
    try:
        got = choose(CONFIG, list(profiles), profiles, budgets, SEQ, link)
    except PlanError:
        return  # nothing fits: nothing to compare
    for d in profiles:
        alone = InferencePlan(
            mode="local", devices=[d], heads=[4], cols=[256], rows=[SEQ], seq_len=SEQ
        )
        if device_memory_bytes(CONFIG, SEQ, 4, 256, SEQ) <= budgets[d]:
            assert got.predicted_s <= predict(alone, CONFIG, profiles, link.bandwidth_bps).total_s
    fastest = min(s for _, s in got.candidates)
    assert got.predicted_s == fastest or (
        len(got.plan.devices) == 1 and fastest >= 0.9 * got.predicted_s
    )


def test_a_split_must_be_predicted_clearly_faster_than_one_device():
    profiles = _profiles(1.0, 1.0)
    budgets = dict.fromkeys(profiles, ROOMY)
    link = Link(1e12, step_latency_s=0.03)
    eager = choose(CONFIG, ["d0", "d1"], profiles, budgets, SEQ, link, margin=0.0)
    alone = min(s for p, s in eager.candidates if len(p.devices) == 1)
    assert len(eager.plan.devices) == 2 and eager.predicted_s < alone
    gain = 1 - eager.predicted_s / alone
    careful = choose(CONFIG, ["d0", "d1"], profiles, budgets, SEQ, link, margin=gain + 0.01)
    assert careful.plan.mode == "local" and careful.predicted_s == alone


def test_rings_price_every_subset_of_few_devices_and_the_fastest_prefixes_of_many():
    few = list(rings(["a", "b", "c"], {}))
    assert len(few) == 7 and ["a", "c"] in few
    names = [f"d{i}" for i in range(8)]
    speed = {d: float(i) for i, d in enumerate(names)}
    many = list(rings(names, speed))
    assert len(many) == 8 and many[0] == ["d7"] and many[1] == ["d6", "d7"]


def test_step_costs_add_per_ring_step_and_overlap_does_not_hide_them():
    profiles = {"a": _profile("a", step_s=0.01), "b": _profile("b", 2.0, step_s=0.03)}
    for overlap in (False, True):
        plan = InferencePlan(
            mode="galaxy",
            devices=["a", "b"],
            heads=[2, 2],
            cols=[128, 128],
            rows=[8, 8],
            seq_len=SEQ,
            overlap=overlap,
        )
        bare = {d: p.model_copy(update={"step_s": 0.0}) for d, p in profiles.items()}
        base = predict(plan, CONFIG, bare, 1e9)
        got = predict(plan, CONFIG, profiles, 1e9, step_latency_s=0.002)
        # galaxy: 4 (D - 1) steps per layer, each the slowest member's 0.03 s plus 0.002 s
        extra = CONFIG.layers * 4 * (0.03 + 0.002)
        assert got.total_s == pytest.approx(base.total_s + extra)
        assert got.hidden_s == pytest.approx(base.hidden_s)


def test_layer_overhead_adds_per_layer_on_the_slowest_device():
    local = InferencePlan(
        mode="local", devices=["a"], heads=[4], cols=[256], rows=[SEQ], seq_len=SEQ
    )
    plain = {"a": _profile("a")}
    busy = {"a": _profile("a").model_copy(update={"layer_s": 0.05})}
    got = predict(local, CONFIG, busy, 1e9).total_s - predict(local, CONFIG, plain, 1e9).total_s
    assert got == pytest.approx(CONFIG.layers * 0.05)
    with pytest.raises(ConfigError, match="step latency"):
        predict(local, CONFIG, plain, 1e9, step_latency_s=-1.0)
