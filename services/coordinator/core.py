"""The wait for one step's replies as a pure function: `apply(wait, event, now)`.

A job step sends a command to the devices of its plan and waits for one reply
of the current (epoch, round) from each. What the coordinator does meanwhile
(take a matching reply, ignore a stale one, fail on a worker's error, probe a
suspect, declare the silent or the hung lost, give up at the deadline) is
decided here, from the state of the wait and one event at a time, and returned
as commands. Signals that a device may be gone (its control connection closed,
a neighbour's report that its connection closed or its data is overdue) make it
a suspect (`detection`) that is probed unless it is heard from first. The shell
(`Coordinator.gather`) owns the socket and the clock: it feeds what arrived and
a `Tick` now and then, and carries the commands out.
So every rule is tested with scripted events on a fake clock, without sockets.

A wait ends with exactly one of `Complete`, `Fail` or `Lost`; a finished wait
ignores every later event, so a reply or a probe answer that arrives after the
verdict changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from common.ids import DeviceId
from common.messages import Message, WorkerError
from services.coordinator.detection import (
    COORDINATOR,
    Disconnected,
    PeerSilent,
    Reconnected,
    Refused,
    Signal,
    Suspects,
    clear,
    due,
    live,
    lost_reason,
    not_back,
    port_refused,
    refusal,
    suspect,
    take_refused,
)
from services.coordinator.membership import (
    Members,
    Probes,
    check_liveness,
    heard,
    hung,
    probe_sent,
)

__all__ = [
    "DEFAULT_FLAP_GRACE_S",
    "Beats",
    "Command",
    "Complete",
    "Disconnected",
    "Event",
    "Fail",
    "Heard",
    "Log",
    "Lost",
    "PeerSilent",
    "ProbeAnswer",
    "Reconnected",
    "Refused",
    "Reply",
    "SendProbe",
    "Signalled",
    "Tick",
    "Wait",
    "apply",
    "begin",
    "signalled",
]

DEFAULT_FLAP_GRACE_S = 1.0
"""The flap grace of a wait begun without one (the setting's default)."""


@dataclass(frozen=True)
class Wait:
    """The state of one wait: what is wanted, what arrived, and the probes still open."""

    kind: type[Message]
    """The reply wanted (RoundDone, Assigned, ...)."""
    want: frozenset[DeviceId]
    epoch: int
    round_no: int
    started: float
    timeout_s: float
    heartbeat_deadline_s: float
    """Silence longer than this (heartbeat interval times misses) makes a suspect."""
    probe_timeout_s: float
    """A probe unanswered for longer than this makes its suspect dead."""
    watchdog_s: float | None = None
    """Standing still for longer than this makes a device hung; None: no watchdog."""
    members: Members = field(default_factory=dict)
    """The latest heartbeats of every known device (a snapshot from the shell)."""
    probes: Probes = field(default_factory=dict)
    """Probes sent and not answered yet; they outlive the wait (the shell keeps them)."""
    next_nonce: int = 1
    """The nonce of the next probe: a counter in the state keeps `apply` pure."""
    got: Mapping[DeviceId, Message] = field(default_factory=dict)
    watch: frozenset[DeviceId] = frozenset()
    """Devices whose liveness is checked though no reply is wanted of them (a serving
    request's ring: only its first device answers, but any device's loss ends it)."""
    suspects: Suspects = field(default_factory=dict)
    """Devices a signal made suspects, not heard from since; they outlive the wait too."""
    flap_grace_s: float = DEFAULT_FLAP_GRACE_S
    """A closed connection that comes back (the device is heard from) within this is no loss."""
    done: bool = False
    """A verdict was returned: later events change nothing."""

    @property
    def deadline(self) -> float:
        """When the wait fails if replies are still missing."""
        return self.started + self.timeout_s

    @property
    def waited_for(self) -> str:
        """What the wait is for, as error messages name it."""
        return f"{self.kind.__name__} of round {self.round_no}"


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """A message from `device` that reached the inbox (a reply, stale or not, or an error)."""

    device: DeviceId
    msg: Message


@dataclass(frozen=True)
class Beats:
    """The devices' heartbeats as the shell now knows them (its membership snapshot)."""

    members: Members


@dataclass(frozen=True)
class ProbeAnswer:
    """`device` answered probe `nonce`."""

    device: DeviceId
    nonce: int


@dataclass(frozen=True)
class Tick:
    """Time passed: check liveness, the watchdog and the deadline."""


Signalled = Disconnected | Reconnected | PeerSilent | Refused
"""Evidence about a device's liveness from outside its own messages."""

Event = Reply | Beats | ProbeAnswer | Tick | Disconnected | Reconnected | PeerSilent | Refused


# --- commands -----------------------------------------------------------------


@dataclass(frozen=True)
class SendProbe:
    """Send Probe `nonce` to `device`, silent for `silent_s` when it became a suspect."""

    device: DeviceId
    nonce: int
    silent_s: float


@dataclass(frozen=True)
class Heard:
    """`device` answered its probe at `at`: the membership counts that as hearing from it."""

    device: DeviceId
    at: float


@dataclass(frozen=True)
class Lost:
    """Verdict: `devices` are dead or hung; recovery may go on without them."""

    devices: list[DeviceId]
    reason: str


@dataclass(frozen=True)
class Fail:
    """Verdict: the step failed (a worker's error, or the replies took too long)."""

    reason: str


@dataclass(frozen=True)
class Complete:
    """Verdict: every wanted device replied."""

    replies: dict[DeviceId, Message]


@dataclass(frozen=True)
class Log:
    """A line for the log: what was decided and why, with its fields."""

    level: Literal["debug", "info", "warning"]
    event: str
    fields: Mapping[str, object] = field(default_factory=dict)


Command = SendProbe | Heard | Lost | Fail | Complete | Log


def begin(
    kind: type[Message],
    devices: list[DeviceId],
    epoch: int,
    round_no: int,
    now: float,
    timeout_s: float,
    heartbeat_deadline_s: float,
    probe_timeout_s: float,
    watchdog_s: float | None = None,
    members: Members | None = None,
    probes: Probes | None = None,
    next_nonce: int = 1,
    watch: frozenset[DeviceId] = frozenset(),
    suspects: Suspects | None = None,
    flap_grace_s: float = DEFAULT_FLAP_GRACE_S,
) -> Wait:
    """A wait for one `kind` reply of (epoch, round_no) from each of `devices`, from `now`.

    `probes`, `suspects` and `next_nonce` carry over from earlier waits: a
    suspect probed in the last step may answer in this one, a connection that
    closed just before this step is still suspect, and a nonce is never reused.
    """
    among = frozenset(devices) | watch
    return Wait(
        kind=kind,
        want=frozenset(devices),
        epoch=epoch,
        round_no=round_no,
        started=now,
        timeout_s=timeout_s,
        heartbeat_deadline_s=heartbeat_deadline_s,
        probe_timeout_s=probe_timeout_s,
        watchdog_s=watchdog_s,
        members=dict(members or {}),
        probes=dict(probes or {}),
        next_nonce=next_nonce,
        watch=watch - frozenset(devices),
        suspects={d: v for d, v in (suspects or {}).items() if d in among},
        flap_grace_s=flap_grace_s,
        done=not devices,
    )


def apply(wait: Wait, event: Event, now: float) -> tuple[Wait, list[Command]]:
    """The wait after `event` at time `now`, and what the shell must do about it."""
    if wait.done:
        return wait, []
    if isinstance(event, Reply):
        return _on_reply(wait, event)
    if isinstance(event, Beats):
        return replace(wait, members=dict(event.members)), []
    if isinstance(event, ProbeAnswer):
        return _on_probe_answer(wait, event, now)
    if isinstance(event, Disconnected | Reconnected | PeerSilent | Refused):
        among = wait.want | wait.watch
        suspects, commands = signalled(
            wait.suspects, wait.members, event, among, wait.epoch, wait.flap_grace_s, now
        )
        return replace(wait, suspects=suspects), [*commands]
    return _on_tick(wait, now)


def signalled(
    suspects: Suspects,
    members: Members,
    event: Signalled,
    among: frozenset[DeviceId],
    epoch: int,
    flap_grace_s: float,
    now: float,
) -> tuple[Suspects, list[Log]]:
    """Suspects after `event`, and what to log: the rule for a wait and between waits alike.

    A closed connection makes a suspect probed after the grace, a neighbour's
    overdue data one probed at once; a reconnect clears it; a refused data port
    after a closed connection makes it lost at the next tick. A neighbour's report
    that does not fit the running plan and epoch is dropped with a warning that
    names its sender (a peer's word is evidence only where it can be checked).
    """
    why = refusal(event.reporter, event.device, among, event.epoch, epoch)
    how = "reconnected" if isinstance(event, Reconnected) else "disconnected"
    if isinstance(event, PeerSilent | Refused):
        how = "silent" if isinstance(event, PeerSilent) else "refused"
    if why is not None:
        dropped = {"peer": event.reporter, "about": event.device, "how": how, "reason": why}
        if event.reporter == COORDINATOR and event.epoch is None:  # any client's socket
            return suspects, [Log("debug", "ignored a closed connection", dropped)]
        return suspects, [Log("warning", "dropped a liveness report", dropped)]
    if isinstance(event, Reconnected):
        if event.device not in suspects:
            return suspects, []
        back = {"device": event.device, "reporter": event.reporter}
        return clear(suspects, [event.device]), [Log("info", "suspect reconnected", back)]
    if isinstance(event, Refused):
        taken, no = take_refused(suspects, members, event.device, event.at)
        note = {"device": event.device, "ignored": no} if no else {"device": event.device}
        return taken, [Log("debug" if no else "warning", "data port refused a connection", note)]
    if isinstance(event, Disconnected):
        signal = Signal(event.at, event.reporter, "disconnected")
        probe_at = event.at + flap_grace_s
    else:
        signal = Signal(now, event.reporter, "silent", event.waited_s)
        probe_at = now
    fields: dict[str, object] = {
        "device": event.device,
        "signal": signal.text(now),
        "probe_in_s": round(max(0.0, probe_at - now), 3),
    }
    return suspect(suspects, members, event.device, signal, probe_at), [
        Log("warning", "suspect", fields)
    ]


def _on_reply(wait: Wait, event: Reply) -> tuple[Wait, list[Command]]:
    """Take a reply of this step, fail on an error of this epoch, ignore anything else."""
    peer, msg = event.device, event.msg
    if isinstance(msg, WorkerError) and msg.epoch == wait.epoch and peer in wait.want:
        reason = f"worker {peer} failed in round {msg.round}: {msg.error}"
        return replace(wait, done=True), [Fail(reason)]
    if (
        isinstance(msg, wait.kind)
        and peer in wait.want
        and getattr(msg, "epoch", None) == wait.epoch
        and getattr(msg, "round", None) == wait.round_no
    ):
        got = {**wait.got, peer: msg}
        if len(got) == len(wait.want):
            return replace(wait, got=got, done=True), [Complete(got)]
        return replace(wait, got=got), []
    # an old epoch's or round's reply (a late RoundDone after a recovery), or not ours
    return wait, [Log("debug", "ignored stale reply", {"peer": peer, "type": msg.type})]


def _on_probe_answer(wait: Wait, event: ProbeAnswer, now: float) -> tuple[Wait, list[Command]]:
    """An answer to the open probe clears the suspect; any other answer changes nothing."""
    open_ = wait.probes.get(event.device)
    if open_ is None or open_.nonce != event.nonce or event.device not in wait.members:
        # late (the device was declared dead meanwhile) or stale
        why = {"device": event.device, "nonce": event.nonce}
        return wait, [Log("info", "ignored a probe answer nobody waits for", why)]
    probes = {d: p for d, p in wait.probes.items() if d != event.device}
    members = heard(wait.members, event.device, now)
    return replace(wait, probes=probes, members=members), [
        Heard(event.device, now),
        Log("info", "suspect answered the probe", {"device": event.device}),
    ]


def _on_tick(wait: Wait, now: float) -> tuple[Wait, list[Command]]:
    """Probe new suspects; then the dead, the hung and the deadline, in that order.

    A suspect is a device whose heartbeats are overdue or whose signals'
    grace is over with nothing heard from it since (`detection.due`); one whose
    control connection closed and did not come back within the grace, or whose
    data port then refused a connection, is lost at once (`detection.not_back`,
    `port_refused`): a probe could not even reach it. Devices
    that fail at the same check fail together: one `Lost` names them all, so
    the job recovers once without all of them rather than once per device. The
    dead are reported before the hung (a device found hung in the same tick is
    found again in the next step's wait, after recovery).
    """
    among = wait.want | wait.watch
    suspects = live(wait.suspects, wait.members)  # those heard from since are cleared
    found = check_liveness(
        wait.members,
        wait.probes,
        now,
        among,
        wait.heartbeat_deadline_s,
        wait.probe_timeout_s,
    )
    gone = [
        *not_back(suspects, wait.members, now, among, wait.flap_grace_s),
        *port_refused(suspects, wait.members, among),
    ]
    if dead := sorted({*found.dead, *gone}):
        probes = {d: p for d, p in found.probes.items() if d not in dead}
        reason = lost_reason(
            dead,
            wait.members,
            found.probes,
            suspects,
            now,
            wait.probe_timeout_s,
            wait.waited_for,
            wait.flap_grace_s,
        )
        suspects = clear(suspects, dead)
        return replace(wait, probes=probes, suspects=suspects, done=True), [Lost(dead, reason)]
    probes, nonce = found.probes, wait.next_nonce
    commands: list[Command] = []
    signalled_ = [d for d in due(suspects, wait.members, now, among) if d not in probes]
    for d in [*found.probe, *(d for d in signalled_ if d not in found.probe)]:
        probes = probe_sent(wait.members, probes, d, nonce, now)
        commands.append(SendProbe(d, nonce, probes[d].silent_s))
        nonce += 1
    wait = replace(wait, probes=probes, suspects=suspects, next_nonce=nonce)
    if wait.watchdog_s is not None:
        waiting = [d for d in wait.want if d not in wait.got and d not in probes]
        if stuck := hung(wait.members, now, waiting, wait.watchdog_s, wait.started):
            one = len(stuck) == 1
            who = f"worker {stuck[0]} heartbeats" if one else f"workers {stuck} heartbeat"
            reason = (
                f"{who} but made no progress for {wait.watchdog_s:g} s in round "
                f"{wait.round_no} (watchdog)"
            )
            return replace(wait, done=True), [*commands, Lost(stuck, reason)]
    if now > wait.deadline:
        missing = sorted(wait.want - set(wait.got))
        reason = f"no {wait.waited_for} from {missing} within {wait.timeout_s:g} s"
        return replace(wait, done=True), [*commands, Fail(reason)]
    return wait, commands
