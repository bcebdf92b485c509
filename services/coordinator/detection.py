"""Signals that a device may be lost, kept as pure bookkeeping for the wait's core.

Missed heartbeats find a silent device only after the heartbeat deadline. A
process that dies has its TCP connections closed by the kernel at once, so the
coordinator's own control socket (its monitor) and the device's neighbours (a
`PeerDown` on their control link) know within milliseconds; a neighbour whose
data from the device is overdue says so too. None of these is trusted alone: a
connection that comes back within the flap grace (a flaky Wi-Fi link) is no
loss, and a neighbour's wait may only mean the device is slow. So a signal makes
the device a *suspect*: anything heard from it after the signal (a heartbeat, a
probe's answer, a neighbour's "reconnected") clears it; otherwise it is probed
(a closed connection once its grace is over, a silent one at once), and only an
unanswered probe makes it lost (`core._on_tick`). The reason then names every
signal, so a person reading the recovery sees what was known and when.

Memory is bounded: only devices of the wait (the running plan) are kept, each
with at most `MAX_SIGNALS` signals.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from common.ids import DeviceId
from services.coordinator.membership import Members, Probes

__all__ = [
    "COORDINATOR",
    "MAX_SIGNALS",
    "Signal",
    "Suspects",
    "Suspicion",
    "clear",
    "describe",
    "due",
    "live",
    "lost_reason",
    "refusal",
    "suspect",
]

COORDINATOR = DeviceId("coordinator")
"""The reporter of what the coordinator's own control socket saw."""
MAX_SIGNALS = 8
"""Signals kept per suspect (the oldest go): enough to name every neighbour of a stage."""


@dataclass(frozen=True)
class Signal:
    """One piece of evidence: who saw what about the device, and when."""

    at: float
    reporter: DeviceId
    how: Literal["disconnected", "silent"]
    waited_s: float = 0.0
    """For "silent": how long the reporter waited for the device's data."""

    def text(self, now: float) -> str:
        """The signal as a reason names it ("control connection closed 0.31 s ago")."""
        ago = max(0.0, now - self.at)
        if self.reporter == COORDINATOR:
            return f"control connection closed {ago:.2f} s ago"
        if self.how == "disconnected":
            return f"{self.reporter} reported its connection to it closed {ago:.2f} s ago"
        return f"{self.reporter} waited {self.waited_s:.2f} s for its data"


@dataclass(frozen=True)
class Suspicion:
    """A device under suspicion: since when, when to probe it, and the evidence."""

    since: float
    """The earliest signal still standing: anything heard from the device after it clears."""
    probe_at: float
    """When it is probed if nothing was heard from it (a closed connection: after the grace)."""
    signals: tuple[Signal, ...]


Suspects = Mapping[DeviceId, Suspicion]


def refusal(
    reporter: DeviceId,
    device: DeviceId,
    among: Collection[DeviceId],
    epoch: int | None,
    current: int,
) -> str | None:
    """Why a signal about `device` from `reporter` is not taken, or None when it is.

    The coordinator's own socket (`COORDINATOR`, no epoch) speaks of any peer
    that connects, so a device outside the wait is simply not ours. A
    neighbour's report must come from a device of the wait, about another one,
    in the current plan epoch: anything else is stale or made up.
    """
    if device not in among:
        return f"{device} is not a device of the running plan"
    if reporter == COORDINATOR and epoch is None:
        return None
    if reporter not in among:
        return f"the reporter {reporter} is not a device of the running plan"
    if reporter == device:
        return f"{reporter} reported itself"
    if epoch != current:
        return f"its plan epoch {epoch} is not the current {current}"
    return None


def live(suspects: Suspects, members: Members) -> dict[DeviceId, Suspicion]:
    """The suspects not heard from since their suspicion began (the others are cleared)."""
    return {
        d: s for d, s in suspects.items() if (m := members.get(d)) is None or m.last_seen <= s.since
    }


def suspect(
    suspects: Suspects, members: Members, device: DeviceId, signal: Signal, probe_at: float
) -> dict[DeviceId, Suspicion]:
    """`suspects` with `signal` about `device`, probed at `probe_at` at the latest.

    A suspicion already cleared (the device was heard from since) starts
    afresh; a standing one keeps its start and takes the earlier probe time.
    """
    old = live(suspects, members).get(device)
    if old is None:
        new = Suspicion(signal.at, probe_at, (signal,))
    else:
        new = replace(
            old,
            since=min(old.since, signal.at),
            probe_at=min(old.probe_at, probe_at),
            signals=(*old.signals, signal)[-MAX_SIGNALS:],
        )
    return {**suspects, device: new}


def clear(suspects: Suspects, devices: Collection[DeviceId]) -> dict[DeviceId, Suspicion]:
    """`suspects` without `devices` (it came back, or its loss was declared)."""
    return {d: s for d, s in suspects.items() if d not in devices}


def due(
    suspects: Suspects, members: Members, now: float, among: Collection[DeviceId]
) -> list[DeviceId]:
    """Suspects of `among` whose probe is due at `now` (nothing heard from them meanwhile)."""
    return sorted(d for d, s in live(suspects, members).items() if d in among and now >= s.probe_at)


def describe(suspicion: Suspicion, now: float) -> str:
    """Every signal of `suspicion`, oldest first, as one phrase."""
    return "; ".join(s.text(now) for s in suspicion.signals)


def lost_reason(
    dead: list[DeviceId],
    members: Members,
    probes: Probes,
    suspects: Suspects,
    now: float,
    probe_timeout_s: float,
    waited_for: str,
) -> str:
    """Why `dead` are lost: the signals that made each a suspect, and the unanswered probe.

    Without signals (the heartbeats alone made them suspects) the reason reads
    as it always did.
    """
    if not any(d in suspects for d in dead):
        silent = max(now - members[d].last_seen for d in dead)
        return (
            f"workers {dead} missed heartbeats for {silent:.1f} s and did not answer "
            f"a probe within {probe_timeout_s:g} s while the coordinator waited for "
            f"{waited_for}"
        )
    parts = []
    for d in dead:
        evidence = (
            describe(suspects[d], now)
            if d in suspects
            else f"missed heartbeats for {now - members[d].last_seen:.1f} s"
        )
        parts.append(f"{d}: {evidence}; probe unanswered for {now - probes[d].sent:.2f} s")
    return f"workers {dead} lost while the coordinator waited for {waited_for}: " + "; ".join(parts)
