"""A planned device that never starts its stage is hung at the Assign, not waited on to the timeout.

A device that heartbeats but never takes its Assign (a fake on the LAN, a
process stuck before its control loop) stood the first assignment still
until the round timeout; the watchdog now covers the Assign as it covers a
round. A worker loading its stage says it is waiting (on Redis or peers), so
a slow load is no hang. The device lost that way is not offered again as a
joiner at the next round boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.ids import DeviceId
from common.messages import Heartbeat
from services.coordinator.core import Beats, Log, Tick
from services.coordinator.driver import Command, EpochRaised, ReadCapacities
from services.coordinator.membership import on_heartbeat
from tests.coordinator.test_driver import PLAN, B, Script, addr, job_of, phase_of

LOADING = {"state": "loading", "waiting": True}
"""What a worker's heartbeats say while it builds its stage and loads its weights."""


def beat(s: Script, devices: Iterable[DeviceId], at: float, **fields: object) -> list[Command]:
    """`devices` heartbeat at `at` with `fields` (state, waiting, progress)."""
    s.now = at
    for d in devices:
        hb = Heartbeat.model_validate({"device": d, "data_addr": addr(d), **fields})
        s.members = on_heartbeat(s.members, hb, at)
    return s.feed(Beats(s.members))


def assigning() -> Script:
    """Every device joined at t=0; the Assign of epoch 1 went out at t=0."""
    s = Script(job_of())
    beat(s, PLAN.devices, at=0.0)
    s.feed(EpochRaised(1))
    assert phase_of(s) == "assign"
    return s


def test_a_device_that_never_takes_its_assign_is_hung_after_the_watchdog() -> None:
    s = assigning()
    loading = [d for d in PLAN.devices if d != B]
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        beat(s, loading, at=t, **LOADING)
        beat(s, [B], at=t)  # heartbeats "idle": it never took the Assign
        assert s.feed(Tick()) == []
    commands = s.feed(Tick(), at=5.25)
    reason = "worker b heartbeats but made no progress for 5 s in round 0 (watchdog)"
    assert commands == [
        Log("warning", "devices lost; recovering", {"lost": [B], "round": 0}),
        ReadCapacities(),
    ]
    rec = s.run.recovery
    assert rec is not None and rec.lost == (B,) and rec.reason == reason
    assert B in s.run.passed_over  # never offered again as a joiner


def test_a_slow_load_is_no_hang() -> None:
    s = assigning()
    for t in range(1, 60):
        beat(s, PLAN.devices, at=float(t), **LOADING)
        assert s.feed(Tick()) == []
    s.assigned(at=60.0)
    assert phase_of(s) == "round"
