"""Pure bookkeeping of which workers are alive, and of what a heartbeat may cost.

`on_heartbeat(state, hb, now) -> state`, `admit(state, hb, now, rules, keep)`,
`dead(state, now, ...)` and `expired(state, now, ...)` are pure functions of
their inputs so liveness and flood rules are tested without sockets or clocks.
A heartbeat costs the coordinator a Redis write at most once a second per
device, an unknown device takes memory only up to a cap, and a device that
stops heartbeating is forgotten after the expiry time, so no stream of
heartbeats, from one id or from thousands, grows state or load without bound.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, replace

from common.ids import DeviceId
from common.messages import Heartbeat

__all__ = [
    "Member",
    "Members",
    "Rules",
    "Verdict",
    "admit",
    "dead",
    "expired",
    "forget",
    "on_heartbeat",
    "unassigned",
]


@dataclass(frozen=True)
class Member:
    """The latest heartbeat of a worker, when it arrived, and when Redis last got it."""

    device: DeviceId
    last_seen: float
    info: Heartbeat
    beats: int = 1
    written: float | None = None
    """When its state was last written to Redis (None: not yet)."""


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
    member = (
        Member(hb.device, now, hb)
        if old is None
        else replace(old, last_seen=now, info=hb, beats=old.beats + 1)
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
