"""Pure bookkeeping of which workers are alive, and of what a heartbeat may cost.

`on_heartbeat(state, hb, now) -> state`, `admit(state, hb, now, rules, keep)`,
`dead(state, now, ...)` and `expired(state, now, ...)` are pure functions of
their inputs so liveness and flood rules are tested without sockets or clocks.
A heartbeat costs the coordinator a Redis write at most once a second per
device, an unknown device takes memory only up to a cap, and a device that
stops heartbeating is forgotten after the expiry time, so no stream of
heartbeats, from one id or from thousands, grows state or load without bound.

Detection is pure too: `check_liveness` turns a device of the running job
whose heartbeats are overdue into a suspect to probe, and a probe left
unanswered for the probe timeout into a dead device; `on_probe_reply` (or `heard`) clears
a suspect; `hung` finds devices that heartbeat without progress for longer
than the watchdog (`watchdog_s`). Only these three facts fail a device, so a
straggler that heartbeats and progresses never is.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, replace

from common.ids import DeviceId
from common.messages import Heartbeat

__all__ = [
    "Liveness",
    "Member",
    "Members",
    "Probes",
    "Probing",
    "Rules",
    "Verdict",
    "admit",
    "check_liveness",
    "dead",
    "expired",
    "forget",
    "heard",
    "hung",
    "on_heartbeat",
    "on_probe_reply",
    "probe_sent",
    "unassigned",
    "watchdog_s",
]


@dataclass(frozen=True)
class Member:
    """The latest heartbeat of a worker, when it was last heard from, and when Redis got it."""

    device: DeviceId
    last_seen: float
    """When it was last heard from: its latest heartbeat, or its answer to a probe."""
    info: Heartbeat
    beats: int = 1
    written: float | None = None
    """When its state was last written to Redis (None: not yet)."""
    progressed: float | None = None
    """When a heartbeat last showed its progress count move, or it waiting on a peer or
    Redis (a wait with its own bound); None: when it joined."""

    @property
    def still_since(self) -> float:
        """Since when its heartbeats show it standing still (neither progressing nor waiting)."""
        return self.last_seen if self.progressed is None else self.progressed


Members = dict[DeviceId, Member]


@dataclass(frozen=True)
class Rules:
    """What heartbeats may cost: Redis writes per device, memory for unknown devices."""

    write_every_s: float = 1.0
    """Least time between two Redis writes of one device's state."""
    expiry_s: float = 30.0
    """A device not heard from for this long is forgotten (unless kept)."""
    max_unassigned: int = 256
    """Most devices known but not kept; heartbeats of further new ids are dropped."""


class Verdict(enum.Enum):
    """What the coordinator does with one heartbeat after `admit`."""

    JOINED = "joined"
    """A new device: remembered, and its state written at once (`asteroid status` sees it)."""
    WRITE = "write"
    """A known device whose state is due for its (rate-limited) Redis write."""
    LIMITED = "limited"
    """A known device written less than `write_every_s` ago: memory only."""
    DROPPED = "dropped"
    """A new device beyond the cap of unassigned devices: ignored entirely."""


def on_heartbeat(state: Members, hb: Heartbeat, now: float) -> Members:
    """State after heartbeat `hb` arrived at time `now` (registers new workers)."""
    old = state.get(hb.device)
    if old is None:
        return {**state, hb.device: Member(hb.device, now, hb, progressed=now)}
    moved = hb.waiting or hb.progress != old.info.progress
    member = replace(
        old,
        last_seen=now,
        info=hb,
        beats=old.beats + 1,
        progressed=now if moved else old.progressed,
    )
    return {**state, hb.device: member}


def admit(
    state: Members,
    hb: Heartbeat,
    now: float,
    rules: Rules,
    keep: Collection[DeviceId] = (),
) -> tuple[Members, Verdict]:
    """State after heartbeat `hb` at `now`, and whether Redis should get it.

    Devices in `keep` (those the running job's plan names) never count
    against the cap, so a flood of made-up ids cannot lock a planned worker
    out. A returned WRITE or JOINED state already records the write at `now`.
    """
    old = state.get(hb.device)
    if old is None and hb.device not in keep and unassigned(state, keep) >= rules.max_unassigned:
        return state, Verdict.DROPPED
    new = on_heartbeat(state, hb, now)
    if old is not None and old.written is not None and now - old.written < rules.write_every_s:
        return new, Verdict.LIMITED
    new[hb.device] = replace(new[hb.device], written=now)
    return new, Verdict.JOINED if old is None else Verdict.WRITE


def unassigned(state: Members, keep: Collection[DeviceId] = ()) -> int:
    """How many known devices count against the cap (those not in `keep`)."""
    return sum(1 for d in state if d not in keep)


def dead(state: Members, now: float, interval_s: float, misses: int) -> list[DeviceId]:
    """Workers whose last heartbeat is older than `misses` intervals."""
    return sorted(d for d, m in state.items() if now - m.last_seen > interval_s * misses)


def expired(
    state: Members, now: float, expiry_s: float, keep: Collection[DeviceId] = ()
) -> list[DeviceId]:
    """Devices not heard from for longer than `expiry_s`, except those in `keep`.

    Kept devices stay: a running job reports a planned worker that stopped as
    dead (and fails), which it could not do once the worker was forgotten.
    """
    return sorted(d for d, m in state.items() if d not in keep and now - m.last_seen > expiry_s)


def forget(state: Members, devices: Collection[DeviceId]) -> Members:
    """State without `devices`."""
    return {d: m for d, m in state.items() if d not in devices}


# --- detection: suspects, probes, hung devices -------------------------------


@dataclass(frozen=True)
class Probing:
    """A probe sent to a suspect and not answered yet."""

    nonce: int
    sent: float
    silent_s: float
    """How long the device had not been heard from when it was probed."""


Probes = dict[DeviceId, Probing]


@dataclass(frozen=True)
class Liveness:
    """What `check_liveness` found: probes still open, suspects to probe, the dead."""

    probes: Probes
    """Open probes: sent, neither answered nor followed by a heartbeat yet."""
    probe: list[DeviceId]
    """Suspects not probed yet: probe each now and record it with `probe_sent`."""
    dead: list[DeviceId]
    """Suspects that left their probe unanswered for longer than the probe timeout."""


def check_liveness(
    state: Members,
    probes: Probes,
    now: float,
    among: Collection[DeviceId],
    deadline_s: float,
    probe_timeout_s: float,
) -> Liveness:
    """Which devices of `among` to probe and which are dead, at time `now`.

    A device not heard from for longer than `deadline_s` (heartbeat interval
    times misses) is a suspect and gets one probe; hearing from it again (a
    heartbeat, or the answer) clears the probe; a probe unanswered for longer
    than `probe_timeout_s` makes it dead. Missed heartbeats alone never do: a
    heartbeat may be lost or late while the device is fine.
    """
    open_ = {
        d: p
        for d, p in probes.items()
        if d in among and d in state and state[d].last_seen <= p.sent
    }
    suspects = [d for d in dead(state, now, deadline_s, 1) if d in among]
    return Liveness(
        probes=open_,
        probe=[d for d in suspects if d not in open_],
        dead=sorted(d for d, p in open_.items() if now - p.sent > probe_timeout_s),
    )


def probe_sent(state: Members, probes: Probes, device: DeviceId, nonce: int, now: float) -> Probes:
    """Open probes after probe `nonce` was sent to `device` at `now`."""
    silent = now - state[device].last_seen if device in state else 0.0
    return {**probes, device: Probing(nonce, now, silent)}


def on_probe_reply(
    state: Members, probes: Probes, device: DeviceId, nonce: int, now: float
) -> tuple[Members, Probes, bool]:
    """State and open probes after `device` answered probe `nonce` at `now`; True if it counted.

    The answer to the open probe counts as hearing from the device. Any other
    (a stale nonce, or an answer after the device was declared dead and its
    probe closed) changes nothing.
    """
    open_ = probes.get(device)
    if open_ is None or open_.nonce != nonce or device not in state:
        return state, probes, False
    rest = {d: p for d, p in probes.items() if d != device}
    return heard(state, device, now), rest, True


def heard(state: Members, device: DeviceId, now: float) -> Members:
    """State after `device` answered its probe at `now`: heard from, like a heartbeat.

    Its progress is left as it was: an answer proves the process is there, not
    that it moves, so the watchdog still sees a hung device as hung.
    """
    if device not in state:
        return state
    return {**state, device: replace(state[device], last_seen=now)}


def hung(
    state: Members, now: float, among: Collection[DeviceId], watchdog_s: float, since: float
) -> list[DeviceId]:
    """Devices of `among` standing still for longer than `watchdog_s`, counted from `since`.

    Standing still: heartbeats show no progress and no wait on a peer or on
    Redis. A device blocked on a peer is not hung (the peer is, or its own
    task timeout ends the wait), so one hung device of a group does not take
    its waiting peers down with it. `since` is when the wait for the devices
    began: time idle between two commands is not counted.
    """
    return sorted(
        d
        for d in among
        if (m := state.get(d)) is not None and now - max(m.still_since, since) > watchdog_s
    )


def watchdog_s(min_s: float, factor: float, predicted_round_s: float | None) -> float:
    """How long a device may stand still in a round: `factor` rounds as predicted, or `min_s`."""
    return max(min_s, factor * (predicted_round_s or 0.0))
