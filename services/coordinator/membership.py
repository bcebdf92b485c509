"""Pure bookkeeping of which workers are alive.

`on_heartbeat(state, hb, now) -> state` and `dead(state, now, ...)` are pure
functions of their inputs so liveness rules are tested without sockets or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.ids import DeviceId
from common.messages import Heartbeat

__all__ = ["Member", "Members", "dead", "on_heartbeat"]


@dataclass(frozen=True)
class Member:
    """The latest heartbeat of a worker and when it arrived."""

    device: DeviceId
    last_seen: float
    info: Heartbeat
    beats: int = 1


Members = dict[DeviceId, Member]


def on_heartbeat(state: Members, hb: Heartbeat, now: float) -> Members:
    """State after heartbeat `hb` arrived at time `now` (registers new workers)."""
    old = state.get(hb.device)
    member = (
        Member(hb.device, now, hb)
        if old is None
        else replace(old, last_seen=now, info=hb, beats=old.beats + 1)
    )
    return {**state, hb.device: member}


def dead(state: Members, now: float, interval_s: float, misses: int) -> list[DeviceId]:
    """Workers whose last heartbeat is older than `misses` intervals."""
    return sorted(d for d, m in state.items() if now - m.last_seen > interval_s * misses)
