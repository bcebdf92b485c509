"""Signals that a device may be lost, kept as pure bookkeeping for the wait's core.

Missed heartbeats find a silent device only after the heartbeat deadline. A
process that dies has its TCP connections closed by the kernel at once, so the
coordinator's own control socket (its monitor) and the device's neighbours (a
`PeerDown` on their control link) know within milliseconds; a neighbour whose
data from the device is overdue says so too. None of these is trusted alone: a
connection that comes back within the flap grace (a flaky Wi-Fi link) is no
loss, and a neighbour's wait may only mean the device is slow. So a signal makes
the device a *suspect*: anything heard from it after the signal (a heartbeat —
a worker heartbeats at once when it reconnects —, a probe's answer, a
neighbour's "reconnected") clears it. A device whose own control connection
closed and is not back when the grace is over is lost (`not_back`): no probe
could reach it, and waiting out a probe timeout would only delay the recovery.
One whose data port then refused a connection (`Refused`: its kernel says no
process listens, which no link flap produces) is lost at once, without waiting
out the grace (`port_refused`).
Any other suspect (a neighbour's word only, or overdue data) is probed, at once
or after the grace, and only an unanswered probe makes it lost
(`core._on_tick`). The reason names every signal, so a person reading the
recovery sees what was known and when.

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
    "Disconnected",
    "PeerSilent",
    "Reconnected",
    "Refused",
    "Signal",
    "Suspects",
    "Suspicion",
    "clear",
    "describe",
    "due",
    "live",
    "lost_reason",
    "not_back",
    "port_refused",
    "refusal",
    "suspect",
    "take_refused",
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
    how: Literal["disconnected", "silent", "refused"]
    waited_s: float = 0.0
    """For "silent": how long the reporter waited for the device's data."""

    def text(self, now: float) -> str:
        """The signal as a reason names it ("control connection closed 0.31 s ago")."""
        ago = max(0.0, now - self.at)
        if self.how == "refused":
            return "its data port refused a connection"
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


@dataclass(frozen=True)
class Disconnected:
    """`reporter`'s connection to `device` closed at `at`.

    The reporter is `detection.COORDINATOR` for the coordinator's own control
    socket (no epoch), or a neighbour that sent PeerDown in plan `epoch`.
    """

    device: DeviceId
    reporter: DeviceId
    at: float
    epoch: int | None = None


@dataclass(frozen=True)
class Reconnected:
    """`reporter`'s connection to `device` is back: the device is alive."""

    device: DeviceId
    reporter: DeviceId
    epoch: int | None = None


@dataclass(frozen=True)
class PeerSilent:
    """`reporter` waited `waited_s` for `device`'s data, longer than its peer timeout."""

    device: DeviceId
    reporter: DeviceId
    waited_s: float
    epoch: int | None = None


@dataclass(frozen=True)
class Refused:
    """`device`'s data port refused a TCP connect begun at `at`: no process listens there.

    The coordinator checks the port when the device's control connection
    closes, so only the coordinator reports it (no epoch).
    """

    device: DeviceId
    at: float
    reporter: DeviceId = COORDINATOR
    epoch: int | None = None


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
    A reporter's new signal of a kind replaces its earlier one; beyond
    `MAX_SIGNALS` the oldest neighbours' go, never the coordinator's own (it
    alone says the control connection is gone, `not_back`).
    """
    old = live(suspects, members).get(device)
    if old is None:
        return {**suspects, device: Suspicion(signal.at, probe_at, (signal,))}
    kept = [s for s in old.signals if (s.reporter, s.how) != (signal.reporter, signal.how)]
    kept.append(signal)
    while len(kept) > MAX_SIGNALS:
        kept.remove(next(s for s in kept if s.reporter != COORDINATOR))
    new = replace(
        old,
        since=min(old.since, signal.at),
        probe_at=min(old.probe_at, probe_at),
        signals=tuple(kept),
    )
    return {**suspects, device: new}


def take_refused(
    suspects: Suspects, members: Members, device: DeviceId, at: float
) -> tuple[dict[DeviceId, Suspicion], str | None]:
    """`suspects` with `device`'s refused data port, or unchanged and why it was not taken.

    A refusal counts only for a standing suspect whose own control connection
    closed before the check began, and not if the device was heard from after
    that (a worker restarted on the same port answers, and heartbeats).
    """
    v = live(suspects, members).get(device)
    if v is None:
        return dict(suspects), "it is not a suspect"
    if (m := members.get(device)) is not None and m.last_seen > at:
        return dict(suspects), "it was heard from after the check began"
    if not any(_closed_by(s, at) for s in v.signals):
        return dict(suspects), "its control connection did not close before the check"
    signal = Signal(at, COORDINATOR, "refused")
    return suspect(suspects, members, device, signal, v.probe_at), None


def port_refused(
    suspects: Suspects, members: Members, among: Collection[DeviceId]
) -> list[DeviceId]:
    """Suspects of `among` whose control connection closed and then whose data port refused."""
    return sorted(
        d
        for d, v in live(suspects, members).items()
        if d in among
        and any(
            r.how == "refused" and any(_closed_by(c, r.at) for c in v.signals) for r in v.signals
        )
    )


def _closed_by(signal: Signal, at: float) -> bool:
    """`signal` is the coordinator's own control connection closing, at `at` or before."""
    return signal.reporter == COORDINATOR and signal.how == "disconnected" and signal.at <= at


def clear(suspects: Suspects, devices: Collection[DeviceId]) -> dict[DeviceId, Suspicion]:
    """`suspects` without `devices` (it came back, or its loss was declared)."""
    return {d: s for d, s in suspects.items() if d not in devices}


def due(
    suspects: Suspects, members: Members, now: float, among: Collection[DeviceId]
) -> list[DeviceId]:
    """Suspects of `among` whose probe is due at `now` (nothing heard from them meanwhile)."""
    return sorted(d for d, s in live(suspects, members).items() if d in among and now >= s.probe_at)


def not_back(
    suspects: Suspects,
    members: Members,
    now: float,
    among: Collection[DeviceId],
    flap_grace_s: float,
) -> list[DeviceId]:
    """Suspects of `among` whose control connection closed and is not back after the grace.

    The coordinator's own socket saw the connection close at least
    `flap_grace_s` ago and nothing was heard from the device since (a
    reconnecting worker heartbeats at once): a probe would find no connection.
    """
    return sorted(
        d
        for d, v in live(suspects, members).items()
        if d in among
        and any(
            s.reporter == COORDINATOR and s.how == "disconnected" and now >= s.at + flap_grace_s
            for s in v.signals
        )
    )


def describe(suspicion: Suspicion, now: float) -> str:
    """Every signal of `suspicion`, oldest first, as one phrase.

    A refused data port is left out: it is what settled the loss, and the
    reason names it last (`lost_reason`).
    """
    return "; ".join(s.text(now) for s in suspicion.signals if s.how != "refused")


def lost_reason(
    dead: list[DeviceId],
    members: Members,
    probes: Probes,
    suspects: Suspects,
    now: float,
    probe_timeout_s: float,
    waited_for: str,
    flap_grace_s: float = 0.0,
) -> str:
    """Why `dead` are lost: the signals that made each a suspect, and what settled it.

    What settled it is the unanswered probe, or for a device whose control
    connection closed, its data port's refusal or its not coming back within
    the grace. Without signals
    (the heartbeats alone made them suspects) the reason reads as it always did.
    """
    if not any(d in suspects for d in dead):
        silent = max(now - members[d].last_seen for d in dead)
        return (
            f"workers {dead} missed heartbeats for {silent:.1f} s and did not answer "
            f"a probe within {probe_timeout_s:g} s while the coordinator waited for "
            f"{waited_for}"
        )
    closed = set(not_back(suspects, members, now, dead, flap_grace_s))
    nobody = set(port_refused(suspects, members, dead))
    parts = []
    for d in dead:
        evidence = (
            describe(suspects[d], now)
            if d in suspects
            else f"missed heartbeats for {now - members[d].last_seen:.1f} s"
        )
        if d in nobody:
            settled = "its data port refused a connection: no process listens"
        elif d in closed:
            settled = f"not back within the {flap_grace_s:.2f} s grace"
        else:
            settled = f"probe unanswered for {now - probes[d].sent:.2f} s"
        parts.append(f"{d}: {evidence}; {settled}")
    return f"workers {dead} lost while the coordinator waited for {waited_for}: " + "; ".join(parts)
