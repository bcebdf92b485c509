"""The derived detection timeouts: bounds respected, floors, quantiles, bounded memory.

`derive` is pure, so every rule is checked with made-up observations: nothing
measured gives the settings, a quiet cluster gives the floors, a loaded one
something between, and no flood of observations grows `Observed`.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.ids import DeviceId
from common.settings import CoordinatorSettings
from services.coordinator.timeouts import (
    FLAP_FLOOR_S,
    K_BEAT,
    K_PEER,
    K_PROBE,
    MAX_DEVICES,
    MIN_SAMPLES,
    PEER_FLOOR_S,
    PROBE_FLOOR_S,
    WINDOW,
    Bounds,
    Effective,
    Observed,
    derive,
    forget,
    observe_beat,
    observe_round,
    observe_rtt,
    on_plan,
    quantile,
)

A, B = DeviceId("a"), DeviceId("b")
BOUNDS = Bounds.of(CoordinatorSettings())
FIELDS = ("heartbeat_deadline_s", "probe_timeout_s", "flap_grace_s", "peer_timeout_s")


def beats(obs: Observed, device: DeviceId, gaps: list[float], start: float = 0.0) -> Observed:
    """`obs` after heartbeats of `device` at `start` and then after each of `gaps`."""
    now = start
    obs = observe_beat(obs, device, now)
    for gap in gaps:
        now += gap
        obs = observe_beat(obs, device, now)
    return obs


def test_bounds_come_from_the_settings() -> None:
    s = CoordinatorSettings(
        heartbeat_s=0.25,
        heartbeat_misses=4,
        probe_timeout_s=1.5,
        flap_grace_s=0.8,
        peer_timeout_s=30.0,
        derive_timeouts=False,
    )
    b = Bounds.of(s)
    assert (b.heartbeat_s, b.heartbeat_deadline_s, b.probe_timeout_s) == (0.25, 1.0, 1.5)
    assert (b.flap_grace_s, b.peer_timeout_s, b.derive) == (0.8, 30.0, False)


def test_nothing_measured_gives_the_bounds() -> None:
    eff = derive(BOUNDS, Observed())
    assert eff.heartbeat_deadline_s == BOUNDS.heartbeat_deadline_s == 3.0
    assert eff.probe_timeout_s == BOUNDS.probe_timeout_s
    assert eff.peer_timeout_s == BOUNDS.peer_timeout_s
    assert eff.flap_grace_s == BOUNDS.flap_grace_s
    assert set(eff.why) == set(FIELDS)
    assert "nothing measured" in eff.why["heartbeat_deadline_s"]


def test_too_few_samples_are_no_measurement() -> None:
    obs = beats(Observed(), A, [0.5] * (MIN_SAMPLES - 1))
    for _ in range(MIN_SAMPLES - 1):
        obs = observe_rtt(obs, A, 0.001)
    eff = derive(BOUNDS, obs)
    assert eff.heartbeat_deadline_s == BOUNDS.heartbeat_deadline_s


def test_a_quiet_cluster_gets_the_floors() -> None:
    obs = beats(Observed(), A, [0.5] * 40)
    for _ in range(20):
        obs = observe_rtt(obs, A, 0.001)
        obs = observe_round(obs, 0.1)
    eff = derive(BOUNDS, obs)
    assert eff.heartbeat_deadline_s == 3 * BOUNDS.heartbeat_s  # K_BEAT x 0.5 s
    assert eff.probe_timeout_s == PROBE_FLOOR_S
    assert eff.flap_grace_s == FLAP_FLOOR_S
    assert eff.peer_timeout_s == PEER_FLOOR_S
    assert eff.why["probe_timeout_s"].startswith("floor")


def test_a_loaded_cluster_gets_k_times_the_measured_quantile() -> None:
    gaps = [0.5] * 60 + [0.7] * 4  # the worst of 64 gaps: 0.7 s, above the p99 rank
    obs = beats(Observed(), A, gaps)
    for rtt in [0.01] * 60 + [0.05] * 4:
        obs = observe_rtt(obs, A, rtt)
    for r in [0.9] * 9 + [2.0]:
        obs = observe_round(obs, r)
    eff = derive(BOUNDS, obs)
    assert eff.heartbeat_deadline_s == pytest.approx(K_BEAT * 0.7)
    assert eff.probe_timeout_s == pytest.approx(K_PROBE * 0.05)
    assert eff.peer_timeout_s == pytest.approx(K_PEER * 0.9)  # p90: one slow round is not it
    assert eff.why["heartbeat_deadline_s"] == "measured (3 x p99 gap 700 ms)"
    assert "p90 round 900 ms" in eff.why["peer_timeout_s"]


def test_the_worst_device_sets_the_deadline() -> None:
    obs = beats(Observed(), A, [0.5] * 20)
    obs = beats(obs, B, [0.8] * 20)
    assert derive(BOUNDS, obs).heartbeat_deadline_s == pytest.approx(K_BEAT * 0.8)


def test_a_measurement_beyond_the_bound_gives_the_bound() -> None:
    obs = beats(Observed(), A, [1.4] * 20)  # 3 x 1.4 s > the 3 s bound
    for _ in range(10):
        obs = observe_rtt(obs, A, 1.0)
        obs = observe_round(obs, 100.0)
    eff = derive(BOUNDS, obs)
    assert eff.heartbeat_deadline_s == BOUNDS.heartbeat_deadline_s
    assert eff.probe_timeout_s == BOUNDS.probe_timeout_s
    assert eff.flap_grace_s == BOUNDS.flap_grace_s
    assert eff.peer_timeout_s == BOUNDS.peer_timeout_s
    assert all(eff.why[f].startswith("bound") for f in FIELDS)


def test_outages_are_not_jitter() -> None:
    """A gap longer than the deadline bound (a pause, a suspect) does not stretch the deadline."""
    obs = beats(Observed(), A, [0.5] * 30 + [20.0] * 5 + [0.5] * 5)
    assert derive(BOUNDS, obs).heartbeat_deadline_s == 3 * BOUNDS.heartbeat_s


def test_a_bound_below_the_floor_wins() -> None:
    """A user who sets a tighter timeout than the floor gets it: the setting is a promise."""
    b = Bounds.of(CoordinatorSettings(probe_timeout_s=0.05, flap_grace_s=0.1, peer_timeout_s=0.5))
    obs = beats(Observed(), A, [0.5] * 20)
    for _ in range(10):
        obs = observe_rtt(obs, A, 0.0001)
        obs = observe_round(obs, 0.01)
    eff = derive(b, obs)
    assert (eff.probe_timeout_s, eff.flap_grace_s, eff.peer_timeout_s) == (0.05, 0.1, 0.5)
    assert derive(b, Observed()).flap_grace_s == 0.1


def test_derive_off_gives_the_settings() -> None:
    b = Bounds.of(CoordinatorSettings(derive_timeouts=False))
    obs = beats(Observed(), A, [0.5] * 30)
    eff = derive(b, obs)
    assert eff.heartbeat_deadline_s == 3.0 and eff.flap_grace_s == b.flap_grace_s
    assert all("derive_timeouts off" in eff.why[f] for f in FIELDS)


def test_without_probes_heartbeat_lateness_stands_in_for_the_round_trip() -> None:
    obs = beats(Observed(), A, [0.5] * 30 + [0.58] * 2)
    eff = derive(BOUNDS, obs)
    assert eff.probe_timeout_s == pytest.approx(K_PROBE * 0.08)
    assert "heartbeat lateness 80 ms" in eff.why["probe_timeout_s"]


def test_the_predicted_round_counts_until_rounds_are_measured() -> None:
    obs = on_plan(Observed(), 0.8)
    assert derive(BOUNDS, obs).peer_timeout_s == pytest.approx(K_PEER * 0.8)
    for _ in range(3):
        obs = observe_round(obs, 2.0)
    assert derive(BOUNDS, obs).peer_timeout_s == pytest.approx(K_PEER * 2.0)
    obs = on_plan(obs, 0.5)  # a new plan: the old rounds no longer say anything
    assert obs.rounds == ()
    assert derive(BOUNDS, obs).peer_timeout_s == pytest.approx(K_PEER * 0.5)
    assert on_plan(obs, None).predicted_round_s is None
    assert on_plan(obs, math.nan).predicted_round_s is None


def test_nonsense_observations_are_dropped() -> None:
    obs = Observed()
    for bad in (math.nan, math.inf, -1.0, 1e9):
        obs = observe_rtt(obs, A, bad)
        obs = observe_round(obs, bad)
        obs = observe_beat(obs, A, bad) if not math.isfinite(bad) else obs
    assert obs.rtts == () and obs.rounds == () and A not in obs.beats


def test_a_clock_that_goes_back_restarts_the_series() -> None:
    obs = beats(Observed(), A, [0.5] * 3, start=100.0)
    obs = observe_beat(obs, A, 50.0)
    assert obs.beats[A].last == 50.0 and min(obs.beats[A].gaps) > 0


def test_observed_is_immutable_and_forget_drops_a_device() -> None:
    obs = beats(Observed(), A, [0.5] * 3)
    later = observe_beat(obs, B, 1.0)
    assert B not in obs.beats and B in later.beats
    with pytest.raises(TypeError):
        later.beats[A] = later.beats[B]  # type: ignore[index]
    assert A not in forget(later, A).beats
    assert forget(later, DeviceId("nobody")) is later


def test_memory_stays_bounded_under_a_flood() -> None:
    obs = Observed()
    for i in range(MAX_DEVICES * 3):
        obs = observe_beat(obs, DeviceId(f"d{i}"), float(i))
    for i in range(WINDOW * 5):
        obs = observe_beat(obs, A, 1e4 + i * 0.5)
        obs = observe_rtt(obs, A, 0.01)
        obs = observe_round(obs, 1.0)
    assert len(obs.beats) <= MAX_DEVICES and A in obs.beats  # the stalest went, not A
    assert len(obs.beats[A].gaps) == WINDOW
    assert len(obs.rtts) == len(obs.rounds) == WINDOW


def test_quantile_is_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0] * 99 + [5.0], 0.99) == 1.0
    assert quantile([1.0] * 98 + [5.0] * 2, 0.99) == 5.0
    assert quantile([7.0], 0.99) == 7.0


_gap = st.floats(0.0, 50.0, allow_nan=False)
_small = st.floats(0.0, 1e4, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(_gap, max_size=80),
    rtts=st.lists(_small, max_size=80),
    rounds=st.lists(_small, max_size=80),
    predicted=st.none() | _small,
    heartbeat_s=st.floats(0.01, 5.0),
    misses=st.integers(1, 20),
    probe=st.floats(0.01, 60.0),
    grace=st.floats(0.01, 60.0),
    peer=st.floats(0.01, 600.0),
)
def test_every_timeout_stays_within_its_bound_and_floor(
    gaps: list[float],
    rtts: list[float],
    rounds: list[float],
    predicted: float | None,
    heartbeat_s: float,
    misses: int,
    probe: float,
    grace: float,
    peer: float,
) -> None:
    b = Bounds(heartbeat_s, heartbeat_s * misses, probe, grace, peer)
    obs = on_plan(beats(Observed(), A, gaps), predicted)
    for rtt in rtts:
        obs = observe_rtt(obs, A, rtt)
    for r in rounds:
        obs = observe_round(obs, r)
    eff = derive(b, obs)
    assert isinstance(eff, Effective) and set(eff.why) == set(FIELDS)
    for value, bound, floor in (
        (eff.heartbeat_deadline_s, b.heartbeat_deadline_s, 3 * heartbeat_s),
        (eff.probe_timeout_s, b.probe_timeout_s, PROBE_FLOOR_S),
        (eff.flap_grace_s, b.flap_grace_s, FLAP_FLOOR_S),
        (eff.peer_timeout_s, b.peer_timeout_s, PEER_FLOOR_S),
    ):
        assert min(floor, bound) <= value <= bound
