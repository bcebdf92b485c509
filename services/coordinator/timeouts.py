"""Detection timeouts derived from what is measured, with the settings as upper bounds.

A fixed heartbeat deadline must be long enough for the slowest, most loaded
device a cluster may ever hold, so on every other cluster a silent device is
found seconds later than it could be. Here each timeout is
``min(upper bound from the settings, max(floor, k x measured))``: the bound
keeps a user's setting a promise (never slower than configured), the floor
keeps a quiet measurement from making detection trigger-happy, and `k` leaves
room above the worst case seen. With nothing measured yet a timeout is its
bound, exactly what the settings alone gave before.

`Observed` keeps bounded windows of what the coordinator saw (heartbeat
inter-arrival gaps per device, probe round trips, round durations); the
`observe_*` functions return a new value and `derive` is a pure function of
the bounds and the observations, so every rule is tested without a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from common.ids import DeviceId

if TYPE_CHECKING:  # the settings load pydantic-settings; the derivation needs none of it
    from common.settings import CoordinatorSettings

__all__ = [
    "BEAT_QUANTILE",
    "FLAP_FLOOR_S",
    "K_BEAT",
    "K_PEER",
    "K_PROBE",
    "MAX_DEVICES",
    "MIN_SAMPLES",
    "PEER_FLOOR_S",
    "PEER_QUANTILE",
    "PROBE_FLOOR_S",
    "RECONNECT_S",
    "WINDOW",
    "Bounds",
    "Effective",
    "Observed",
    "derive",
    "forget",
    "observe_beat",
    "observe_round",
    "observe_rtt",
    "on_plan",
    "quantile",
]

WINDOW = 64
"""Samples kept per series (each device's gaps, probe round trips, rounds): recent enough to
follow a change of load, long enough for a high quantile to mean something."""
MAX_DEVICES = 256
"""Most devices whose heartbeats are tracked; beyond, the one heard from longest ago goes."""
MIN_SAMPLES = 8
"""Fewer samples than this in a series is no measurement: its timeout stays at the bound."""
BEAT_QUANTILE = 0.99
"""Quantile of a device's heartbeat gaps the deadline scales: the worst but one or two of the
window, so a loaded machine's jitter is inside it (a false suspect costs a probe, no more)."""
K_BEAT = 3.0
"""Heartbeat deadline = K_BEAT x the gap quantile: three late heartbeats in a row, as late as
the worst seen, before a device is suspected."""
K_PROBE = 5.0
"""Probe timeout = K_PROBE x the p99 round trip of answered probes (or of heartbeat lateness
before any probe was answered): the answer comes from the worker's control thread at once."""
PROBE_FLOOR_S = 0.2
"""Least probe timeout: one scheduler hiccup of a loaded machine must not kill a device."""
RECONNECT_S = 0.1
"""ZeroMQ's reconnect interval (reconnect_ivl, 100 ms by default, no backoff)."""
FLAP_FLOOR_S = 0.3
"""Least flap grace: a reconnect (RECONNECT_S) plus the heartbeat a worker sends at once on
reconnecting, with room for a loaded machine to schedule both."""
K_PEER = 3.0
"""Neighbour timeout = K_PEER x the p90 round time: a peer's data is due within a round."""
PEER_QUANTILE = 0.9
"""Quantile of the round times the neighbour timeout scales (one slow round is not the norm)."""
PEER_FLOOR_S = 1.0
"""Least neighbour timeout: tiny rounds must not make a short stall look like silence."""
_MAX_S = 1e6
"""Observations above this (or negative, or not finite) are dropped as nonsense."""


@dataclass(frozen=True)
class Bounds:
    """The upper bounds, from the settings: an effective timeout never exceeds its bound."""

    heartbeat_s: float
    """Seconds between a worker's heartbeats (the floor of the deadline scales it)."""
    heartbeat_deadline_s: float
    """heartbeat_s x heartbeat_misses: silence past this makes a suspect."""
    probe_timeout_s: float
    flap_grace_s: float
    peer_timeout_s: float
    """Longest a worker waits for a neighbour's data before reporting it silent."""
    derive: bool = True
    """False: every timeout is its bound (the settings as they are, nothing derived)."""

    @classmethod
    def of(cls, settings: CoordinatorSettings) -> Bounds:
        """The bounds a coordinator's settings give."""
        return cls(
            heartbeat_s=settings.heartbeat_s,
            heartbeat_deadline_s=settings.heartbeat_s * settings.heartbeat_misses,
            probe_timeout_s=settings.probe_timeout_s,
            flap_grace_s=settings.flap_grace_s,
            peer_timeout_s=settings.peer_timeout_s,
            derive=settings.derive_timeouts,
        )


@dataclass(frozen=True)
class _Beats:
    last: float
    gaps: tuple[float, ...] = ()


def _empty() -> MappingProxyType[DeviceId, _Beats]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Observed:
    """What was measured, in bounded windows; immutable (each `observe_*` returns a new one).

    At most MAX_DEVICES x WINDOW heartbeat gaps and WINDOW of each other
    series, however many observations arrive.
    """

    beats: MappingProxyType[DeviceId, _Beats] = field(default_factory=_empty)
    rtts: tuple[float, ...] = ()
    rounds: tuple[float, ...] = ()
    predicted_round_s: float | None = None
    """The plan's predicted round time: the neighbour timeout's basis before rounds ran."""


def _sane(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= _MAX_S


def _push(window: tuple[float, ...], value: float) -> tuple[float, ...]:
    return (*window[-(WINDOW - 1) :], value)


def observe_beat(obs: Observed, device: DeviceId, now: float) -> Observed:
    """`obs` after a heartbeat of `device` arrived at `now` (the gap since its last one counts).

    A heartbeat that arrives earlier than the last one (a clock that went
    back) restarts the device's series rather than recording a negative gap.
    """
    if not math.isfinite(now):
        return obs
    old = obs.beats.get(device)
    beats = dict(obs.beats)
    if old is None or now < old.last:
        beats[device] = _Beats(now, () if old is None else old.gaps)
    else:
        gap = now - old.last
        beats[device] = _Beats(now, _push(old.gaps, gap) if _sane(gap) else old.gaps)
    if len(beats) > MAX_DEVICES:
        stalest = min(beats, key=lambda d: beats[d].last)
        del beats[stalest]
    return replace(obs, beats=MappingProxyType(beats))


def forget(obs: Observed, device: DeviceId) -> Observed:
    """`obs` without `device`'s heartbeats (it left, or was declared dead)."""
    if device not in obs.beats:
        return obs
    return replace(obs, beats=MappingProxyType({d: b for d, b in obs.beats.items() if d != device}))


def observe_rtt(obs: Observed, device: DeviceId, rtt_s: float) -> Observed:
    """`obs` after `device` answered a probe `rtt_s` after it was sent."""
    del device  # one timeout for every device: the window pools them
    return replace(obs, rtts=_push(obs.rtts, rtt_s)) if _sane(rtt_s) else obs


def observe_round(obs: Observed, seconds: float) -> Observed:
    """`obs` after a round took `seconds` from its start to its commit."""
    return replace(obs, rounds=_push(obs.rounds, seconds)) if _sane(seconds) else obs


def on_plan(obs: Observed, predicted_round_s: float | None) -> Observed:
    """`obs` for a new plan: its rounds differ, so earlier round times no longer count."""
    ok = predicted_round_s is not None and _sane(predicted_round_s) and predicted_round_s > 0
    return replace(obs, rounds=(), predicted_round_s=predicted_round_s if ok else None)


@dataclass(frozen=True)
class Effective:
    """The timeouts in force, and for each where it came from (`why`, one phrase per field)."""

    heartbeat_deadline_s: float
    probe_timeout_s: float
    flap_grace_s: float
    peer_timeout_s: float
    why: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))


def quantile(values: tuple[float, ...] | list[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (not empty): one of the values, never between."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _clamp(bound: float, floor: float, measured: float) -> tuple[float, str]:
    """min(bound, max(floor, measured)) and which of the three won.

    A measured value is rounded up to the millisecond, so the timeouts in force
    (and their record in Redis) change only when the measurement does.
    """
    floor = min(floor, bound)  # a bound below the floor is the user's choice: it wins
    measured = math.ceil(measured * 1000 - 1e-6) / 1000
    if measured >= bound:
        return bound, "bound"
    if measured <= floor:
        return floor, "floor"
    return measured, "measured"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1.0 else f"{seconds:.2g} s"


def derive(bounds: Bounds, obs: Observed) -> Effective:
    """The effective timeouts: each min(bound, max(floor, k x measured)), or its bound.

    Heartbeat gaps longer than the bound's deadline are outages (a suspect, a
    pause), not jitter, and are left out; a device with fewer than MIN_SAMPLES
    gaps does not count yet. The deadline scales the worst device's quantile,
    since one deadline serves every device.
    """
    if not bounds.derive:
        return _bounds_only(bounds, "settings (derive_timeouts off)")
    why: dict[str, str] = {}
    gap_q = _beat_quantile(bounds, obs)
    if gap_q is None:
        beat, why["heartbeat_deadline_s"] = bounds.heartbeat_deadline_s, "bound (nothing measured)"
    else:
        beat, won = _clamp(bounds.heartbeat_deadline_s, 3 * bounds.heartbeat_s, K_BEAT * gap_q)
        why["heartbeat_deadline_s"] = f"{won} ({K_BEAT:g} x p99 gap {_ms(gap_q)})"
    rtt: float | None = None
    if len(obs.rtts) >= MIN_SAMPLES:
        rtt, basis = quantile(obs.rtts, 0.99), "p99 rtt"
    elif gap_q is not None:
        rtt, basis = max(0.0, _lateness(bounds, obs)), "p99 heartbeat lateness"
    if rtt is None:
        probe, why["probe_timeout_s"] = bounds.probe_timeout_s, "bound (nothing measured)"
        grace, why["flap_grace_s"] = bounds.flap_grace_s, "bound (nothing measured)"
    else:
        probe, won = _clamp(bounds.probe_timeout_s, PROBE_FLOOR_S, K_PROBE * rtt)
        why["probe_timeout_s"] = f"{won} ({K_PROBE:g} x {basis} {_ms(rtt)})"
        grace, won = _clamp(bounds.flap_grace_s, FLAP_FLOOR_S, RECONNECT_S + K_PROBE * rtt)
        why["flap_grace_s"] = f"{won} (reconnect {_ms(RECONNECT_S)} + {K_PROBE:g} x {basis})"
    if len(obs.rounds) >= min(MIN_SAMPLES, 3):
        basis_s, basis = quantile(obs.rounds, PEER_QUANTILE), "p90 round"
    elif obs.predicted_round_s is not None:
        basis_s, basis = obs.predicted_round_s, "predicted round"
    else:
        basis_s, basis = -1.0, ""
    if basis_s < 0:
        peer, why["peer_timeout_s"] = bounds.peer_timeout_s, "bound (nothing measured)"
    else:
        peer, won = _clamp(bounds.peer_timeout_s, PEER_FLOOR_S, K_PEER * basis_s)
        why["peer_timeout_s"] = f"{won} ({K_PEER:g} x {basis} {_ms(basis_s)})"
    return Effective(beat, probe, grace, peer, MappingProxyType(why))


def _bounds_only(bounds: Bounds, why: str) -> Effective:
    return Effective(
        bounds.heartbeat_deadline_s,
        bounds.probe_timeout_s,
        bounds.flap_grace_s,
        bounds.peer_timeout_s,
        MappingProxyType(
            {
                f: why
                for f in (
                    "heartbeat_deadline_s",
                    "probe_timeout_s",
                    "flap_grace_s",
                    "peer_timeout_s",
                )
            }
        ),
    )


def _usable_gaps(bounds: Bounds, beats: _Beats) -> tuple[float, ...]:
    return tuple(g for g in beats.gaps if g <= bounds.heartbeat_deadline_s)


def _beat_quantile(bounds: Bounds, obs: Observed) -> float | None:
    """The worst device's BEAT_QUANTILE gap, over devices with enough gaps (None: none has)."""
    qs = [
        quantile(gaps, BEAT_QUANTILE)
        for b in obs.beats.values()
        if len(gaps := _usable_gaps(bounds, b)) >= MIN_SAMPLES
    ]
    return max(qs) if qs else None


def _lateness(bounds: Bounds, obs: Observed) -> float:
    """The p99 of how much later than heartbeat_s heartbeats arrived, pooled over devices.

    Before any probe was answered it stands in for the answer's round trip:
    both wait for the worker's control thread to be scheduled, which on a
    loaded machine dominates a LAN's round trip.
    """
    late = [g - bounds.heartbeat_s for b in obs.beats.values() for g in _usable_gaps(bounds, b)]
    return quantile(late, 0.99) if late else 0.0
