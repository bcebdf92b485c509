"""The regrouping band under timing noise: a median-smoothed latency and a dwell."""

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import ConfigError
from common.fl.data import DigitsSplit, load_digits_split
from common.fl.spec import FederationSpec
from services.federation.band import median, pushed, settle_bound
from services.federation.grouping import GroupState, record, regroup
from services.federation.server import Federation
from services.federation.simulate import SimConfig, SlowDown, simulate
from services.federation.strategies import make_strategy, strategy_for

A, B = (10.0, 0.0), (0.0, 10.0)
RT = 0.5
JITTER = 0.9 * RT / (2 + RT)
"""Below the band: two homes at base * (1 -+ JITTER) stay within RT of each other."""


@pytest.fixture(scope="module")
def digits() -> DigitsSplit:
    return load_digits_split(seed=0)


def steady(bases: Sequence[float], size: int, window: int, dwell: int) -> GroupState:
    """Groups of `size` homes each, group g's homes all at latency `bases[g]`."""
    groups = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(len(bases)))
    lats = tuple(b for b in bases for _ in range(size))
    hists = tuple(A if h % 2 else B for h in range(len(lats)))
    return GroupState(groups, lats, hists, rt_fraction=RT, window=window, dwell=dwell)


def base_of(bases: Sequence[float], size: int, home: int) -> float:
    """The home's latency without noise: its group's base."""
    return bases[home // size]


def test_median_and_window() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert pushed((1.0, 2.0, 3.0), 4.0, 3) == (2.0, 3.0, 4.0)
    assert pushed((1.0,), 4.0, 3) == (1.0, 4.0)
    assert settle_bound(1, 1) == 1 and settle_bound(3, 2) == 3 and settle_bound(4, 1) == 3
    with pytest.raises(ConfigError):
        median([])


def test_state_fills_its_window_and_validates_it() -> None:
    s = GroupState(((0, 1),), (1.0, 2.0), (A, B), window=3, dwell=2)
    assert s.recent == ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)) and s.strikes == (0, 0)
    r = record(s, 1, 8.0)
    assert r.recent[1] == (2.0, 2.0, 8.0) and r.latencies == (1.0, 2.0)  # median 2
    r = record(r, 1, 9.0)
    assert r.recent[1] == (2.0, 8.0, 9.0) and r.latencies == (1.0, 8.0)
    good: dict[str, object] = {"window": 3, "dwell": 2}
    for bad in (
        {"window": 0},
        {"dwell": 0},
        {"recent": ((1.0,), (1.0, 1.0, 1.0, 1.0))},
        {"recent": ((1.0,), (-1.0,))},
        {"strikes": (0, 2)},
        {"strikes": (0,)},
    ):
        with pytest.raises(ConfigError):
            GroupState(((0, 1),), (1.0, 2.0), (A, B), **{**good, **bad})  # type: ignore[arg-type]


def test_one_slow_round_moves_a_home_in_algorithm_1_but_not_with_a_window() -> None:
    # groups at 1 s and 4 s; home 0 has one round at 4 s
    plain = steady((1.0, 4.0), 2, window=1, dwell=1)
    assert (regroup(plain, 0, 4.0).action, regroup(plain, 0, 4.0).group) == ("move", 1)
    smooth = steady((1.0, 4.0), 2, window=3, dwell=1)
    out = regroup(smooth, 0, 4.0)
    assert (out.action, out.group, out.state.latencies[0]) == ("stay", 0, 1.0)
    back = regroup(out.state, 0, 1.1)  # median of 1, 4, 1.1
    assert back.action == "stay" and back.state.latencies[0] == 1.1


def test_dwell_waits_for_consecutive_rounds_out_of_band_and_keeps_a_moved_home() -> None:
    s = steady((1.0, 4.0), 2, window=1, dwell=3)
    one = regroup(s, 0, 4.0)
    assert (one.action, one.group, one.state.strikes[0]) == ("stay", 0, 1)
    two = regroup(one.state, 0, 4.0)
    assert (two.action, two.state.strikes[0]) == ("stay", 2)
    reset = regroup(two.state, 0, 1.0)  # back inside: the count starts again
    assert (reset.action, reset.state.strikes[0]) == ("stay", 0)
    state = reset.state
    for _ in range(2):
        state = regroup(state, 0, 4.0).state
    moved = regroup(state, 0, 4.0)
    assert (moved.action, moved.group, moved.state.strikes[0]) == ("move", 1, 0)
    assert moved.state.groups == ((1,), (0, 2, 3))
    # a moved home stays `dwell` rounds where it went, even if its latency falls back
    state = moved.state
    for _ in range(2):
        held = regroup(state, 0, 1.0)
        assert (held.action, held.group) == ("stay", 1)
        state = held.state
    assert (regroup(state, 0, 1.0).action, regroup(state, 0, 1.0).group) == ("move", 0)


def test_a_dropped_home_rejoins_after_the_dwell_and_an_unfit_round_resets_it() -> None:
    s = steady((1.0, 4.0), 2, window=1, dwell=2)
    state = regroup(s, 0, 20.0).state
    dropped = regroup(state, 0, 20.0)
    assert (dropped.action, dropped.group) == ("drop", None)
    first = regroup(dropped.state, 0, 1.0)
    assert (first.action, first.group, first.state.strikes[0]) == ("out", None, 1)
    unfit = regroup(first.state, 0, 20.0)
    assert (unfit.action, unfit.state.strikes[0]) == ("out", 0)
    state = regroup(unfit.state, 0, 1.0).state
    back = regroup(state, 0, 1.0)
    assert (back.action, back.group) == ("rejoin", 0)


def _spiky(draws: Sequence[tuple[float, float | None]], window: int) -> list[float]:
    """Factors of a home's rounds: jitter, and spikes at most (window-1)//2 per window."""
    out: list[float] = []
    last_spike = -window
    for i, (jitter, spike) in enumerate(draws):
        if spike is not None and i - last_spike >= window:
            out.append(spike)
            last_spike = i
        else:
            out.append(1.0 + jitter)
    return out


band_cases = st.fixed_dictionaries(
    {
        "groups": st.integers(2, 3),
        "size": st.integers(2, 3),
        "ratio": st.floats(4.0, 8.0),
        "window": st.sampled_from([3, 5]),
        "dwell": st.integers(1, 3),
        "rounds": st.integers(5, 25),
    }
)


@settings(max_examples=60, deadline=None)
@given(band_cases, st.data())
def test_noise_below_the_band_never_regroups_a_steady_grouping(
    case: dict[str, int | float], data: st.DataObject
) -> None:
    """Jitter below the band, plus single rounds anywhere from 10x faster to 10x slower."""
    groups, size, window = int(case["groups"]), int(case["size"]), int(case["window"])
    bases = [float(case["ratio"]) ** g for g in range(groups)]
    state = steady(bases, size, window, int(case["dwell"]))
    homes = groups * size
    draw = st.tuples(st.floats(-JITTER, JITTER), st.one_of(st.none(), st.floats(0.1, 10.0)))
    factors = [
        _spiky(data.draw(st.lists(draw, min_size=int(case["rounds"]), max_size=40)), window)
        for _ in range(homes)
    ]
    start = state.groups
    for r in range(min(len(f) for f in factors)):
        for members in start:
            for h in members:
                out = regroup(state, h, base_of(bases, size, h) * factors[h][r])
                assert out.action == "stay", (r, h, out)
                state = out.state
    assert state.groups == start and state.dropped == frozenset()


@settings(max_examples=60, deadline=None)
@given(band_cases, st.data())
def test_a_home_three_times_slower_from_some_round_on_regroups_within_the_dwell(
    case: dict[str, int | float], data: st.DataObject
) -> None:
    groups, size, window = int(case["groups"]), int(case["size"]), int(case["window"])
    dwell = int(case["dwell"])
    bases = [float(case["ratio"]) ** g for g in range(groups)]
    state = steady(bases, size, window, dwell)
    slow = data.draw(st.integers(0, groups * size - 1))
    at = data.draw(st.integers(0, int(case["rounds"])))
    jitter = data.draw(st.lists(st.floats(-JITTER, JITTER), min_size=1, max_size=64))
    start, seen, k = state.groups, 0, 0
    mates = next(set(g) for g in start if slow in g)
    events: list[tuple[int, str]] = []
    for r in range(at + settle_bound(window, dwell)):
        for members in start:
            for h in members:
                if h in state.dropped:
                    continue
                factor = 3.0 if h == slow and r >= at else 1.0
                k += 1
                out = regroup(
                    state, h, base_of(bases, size, h) * factor * (1 + jitter[k % len(jitter)])
                )
                state = out.state
                if out.action != "stay":
                    events.append((h, out.action))
                    assert r >= at, ("regrouped before the slow-down", r, h, out)
        seen += 1
        if events:
            break
    assert events, "a home three times slower never left its group"
    # the first to leave is the slowed home or a mate of it; a home it moves into may then
    # push out a member of that group in the same round (Algorithm 1: L^g is the group's mean)
    assert events[0][0] in mates, events
    assert seen - at <= settle_bound(window, dwell)


def test_the_spec_carries_the_band_to_the_strategy_and_a_restored_server() -> None:
    spec = FederationSpec.model_validate(
        {
            "federation_id": "f",
            "model": {"name": "fl_cnn", "num_classes": 10},
            "homes": 4,
            "latency_window": 1,
            "regroup_dwell": 3,
        }
    )
    strategy = strategy_for(spec)
    assert (strategy.window, strategy.dwell) == (1, 3)
    default = strategy_for(spec.model_copy(update={"latency_window": 3, "regroup_dwell": 2}))
    assert (default.window, default.dwell) == (
        FederationSpec.model_fields["latency_window"].default,
        FederationSpec.model_fields["regroup_dwell"].default,
    )
    zero = {"w": torch.zeros(2)}
    fed = Federation(strategy, zero, 4, 100, 10.0)
    for h in range(4):
        fed.join(h, 10, [10, 0] if h % 2 else [0, 10])
    for rnd in range(2):
        tasks = {h: fed.task(h, 10.0 * rnd) for h in range(4)}
        for h in range(4):
            lat = (1.0, 1.0, 4.0, 4.0)[h] * (5.0 if rnd and h == 0 else 1.0)
            fed.submit(h, tasks[h].round_id, zero, 10, lat, 10.0 * rnd + lat)
    assert fed.groups is not None and fed.groups.strikes[0] == 1
    again = Federation(strategy_for(spec), zero, 4, 100, 10.0)
    again.restore(fed.snapshot(), fed.state)
    assert again.groups == fed.groups
    older = fed.snapshot()
    del older["groups"]["recent"], older["groups"]["strikes"]
    again.restore(older, fed.state)
    assert again.groups is not None and again.groups.strikes == (0, 0, 0, 0)
    assert again.groups.recent[0] == (fed.groups.latencies[0],)


def test_the_simulator_regroups_later_with_the_band_and_stays_exact(digits: DigitsSplit) -> None:
    cfg = SimConfig(
        round_times=(1.0, 1.2, 2.0, 2.5),
        slowdowns=(SlowDown(1, 2.0, 3.0),),
        dirichlet_alpha=0.5,
        updates=12,
        local_steps=2,
    )
    plain = simulate(make_strategy("ecofl", groups=2), cfg, digits)
    band = make_strategy("ecofl", groups=2, window=3, dwell=2)
    first = simulate(band, cfg, digits)
    second = simulate(make_strategy("ecofl", groups=2, window=3, dwell=2), cfg, digits)
    assert first.curve == second.curve and first.events == second.events
    assert all(torch.equal(v, second.final_state[k]) for k, v in first.final_state.items())
    assert [(e.home, e.action) for e in plain.events] == [(1, "drop")]
    assert [(e.home, e.action) for e in first.events] == [(1, "drop")]
    # home 1's rounds run every 1.2 s (group 0), then every 3.6 s once slowed at 2 s:
    # Algorithm 1 drops it after its first slow round, the band after its third
    assert first.events[0].time > plain.events[0].time
    assert first.final_groups == plain.final_groups == ((0,), (2, 3))


def test_the_virtual_clock_bench_runs_eco_fl_with_the_specs_band() -> None:
    from tests.bench.bench_fl import BenchConfig, build_strategy

    band = build_strategy("ecofl/band", 2)
    fields = FederationSpec.model_fields
    assert band.name == "ecofl" and (band.window, band.dwell) == (
        fields["latency_window"].default,
        fields["regroup_dwell"].default,
    )
    plain = build_strategy("ecofl/rt=1", 2)
    assert (plain.rt_fraction, plain.window, plain.dwell) == (1.0, 1, 1)
    assert "ecofl/band" in BenchConfig().strategies
