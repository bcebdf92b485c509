"""What a worker tells the coordinator about its neighbours: pure bookkeeping, no sockets.

A worker's neighbours hold its evidence of a loss first: when a worker process
dies, the kernel closes its connections at once, and the DEALERs its pipeline
and ring neighbours hold to its data socket see the close in milliseconds,
long before a heartbeat deadline. A device that goes silent (SIGSTOP, a cable
pulled) closes nothing; its neighbours notice that its data does not come.

Evidence only: the coordinator decides (a connection back within its grace is
no loss). So what is sent must be cheap for it to take and impossible to turn
into a flood: `LinkWatch` reports each change of a neighbour's connection
(one report per transition, coalesced), a few at once and then at most one
per `SPACING_S`, always ending on the connection's true state; `SilenceWatch`
reports a neighbour silent once per round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from common.plan import Plan, routes

__all__ = ["BURST", "SPACING_S", "LinkWatch", "SilenceWatch", "neighbours"]

How = Literal["disconnected", "reconnected"]

BURST = 4
"""Connection reports a neighbour may cause at once in one epoch (two flaps)."""
SPACING_S = 1.0
"""After the burst, at least this long between two reports about one neighbour: a link
that flaps faster is reported by its state once a second, never by its every flap."""


def neighbours(plan: Plan, device: str) -> frozenset[str]:
    """The devices `device` exchanges data with under `plan`, itself excluded.

    The previous stage's devices whose sample ranges overlap its own (they
    send it activations, it sends them gradients), the next stage's likewise,
    and its all-reduce ring's devices before and after it. Every device of a
    plan of more than one device is someone's neighbour, so each loss has a
    witness on the data plane.
    """
    at = [i for i, s in enumerate(plan.stages) if any(a.device == device for a in s.devices)]
    if not at:  # not a device of the plan: nobody to watch
        return frozenset()
    p = at[0]
    out: set[str] = set()
    if p > 0:
        before = routes(plan.ranges(p - 1), plan.ranges(p))
        out.update(str(r.src) for r in before if r.dst == device)
    if p < len(plan.stages) - 1:
        after = routes(plan.ranges(p), plan.ranges(p + 1))
        out.update(str(r.dst) for r in after if r.src == device)
    group = [str(a.device) for a in plan.stages[p].devices]
    if len(group) > 1:
        rank = group.index(device)
        out.update((group[(rank - 1) % len(group)], group[(rank + 1) % len(group)]))
    out.discard(device)
    return frozenset(out)


@dataclass
class _Link:
    """One neighbour's connection: its state and what the coordinator was told of it."""

    up: bool | None = None
    """True: connected (handshake done); False: closed or refused; None: not known yet."""
    told: How | None = None
    """The last report sent this epoch; None: none (the coordinator assumes it up)."""
    sent: int = 0
    """Reports sent about it this epoch."""
    quiet_until: float = 0.0
    """No report before this (monotonic seconds), once the burst is spent."""


@dataclass
class LinkWatch:
    """Connection state of a worker's neighbours in plan `epoch`, and what to report.

    Feed it `connected`/`closed` as the socket monitors say, then ask `due`
    for the reports to send now. A neighbour is reported "disconnected" when
    its connection closes (or is refused) and "reconnected" only after a
    "disconnected", so a report always changes what the coordinator believes.
    Memory is bounded by the plan: only watched neighbours are kept.
    """

    epoch: int = -1
    watched: frozenset[str] = frozenset()
    links: dict[str, _Link] = field(default_factory=dict)

    def repoint(self, epoch: int, watched: Iterable[str]) -> None:
        """Watch `watched` in plan `epoch`; the known states of kept neighbours carry over.

        A new epoch starts with nothing told: a neighbour still disconnected
        is reported again, under the epoch the coordinator now runs.
        """
        self.watched = frozenset(watched)
        kept = {peer: link for peer, link in self.links.items() if peer in self.watched}
        if epoch != self.epoch:  # a new plan: nothing told under it yet
            kept = {peer: _Link(up=link.up) for peer, link in kept.items()}
        self.epoch = epoch
        self.links = kept

    def forget(self, peer: str) -> None:
        """The connection to `peer` was replaced (a new address): its state is unknown again."""
        self.links.pop(peer, None)

    def connected(self, peer: str) -> None:
        """The connection to `peer` is up (its handshake succeeded)."""
        if peer in self.watched:
            self.links.setdefault(peer, _Link()).up = True

    def closed(self, peer: str) -> None:
        """The connection to `peer` closed, or connecting to it was refused."""
        if peer in self.watched:
            self.links.setdefault(peer, _Link()).up = False

    def due(self, now: float) -> list[tuple[str, How]]:
        """The reports to send now: each neighbour whose state differs from what was told."""
        out: list[tuple[str, How]] = []
        for peer in sorted(self.links):
            link = self.links[peer]
            want = _report(link)
            if want is None or (link.sent >= BURST and now < link.quiet_until):
                continue
            link.told = want
            link.sent += 1
            if link.sent >= BURST:
                link.quiet_until = now + SPACING_S
            out.append((peer, want))
        return out


def _report(link: _Link) -> How | None:
    """What to tell about `link` now, or None: its state is what the coordinator was told."""
    if link.up is False and link.told != "disconnected":
        return "disconnected"
    if link.up is True and link.told == "disconnected":
        return "reconnected"
    return None


@dataclass
class SilenceWatch:
    """When a wait for neighbours' data has lasted `timeout_s`, which of them to report silent.

    Once per (round, neighbour): the round is a key the caller chooses (a
    training round, or an evaluation's), and a new epoch starts afresh. Keys
    of rounds before the newest are forgotten, so memory stays bounded.
    """

    timeout_s: float | None = None
    epoch: int = -1
    told: set[tuple[str, int, str]] = field(default_factory=set)

    def reset(self, epoch: int, timeout_s: float | None) -> None:
        """Plan `epoch` with its Assign's `peer_timeout_s` (None: never report)."""
        self.epoch, self.timeout_s = epoch, timeout_s
        self.told.clear()

    def deadline(self, started: float) -> float | None:
        """When a wait begun at `started` makes its awaited neighbours silent; None: never."""
        return None if self.timeout_s is None else started + self.timeout_s

    def due(
        self, key: tuple[str, int], started: float, now: float, awaited: Iterable[str]
    ) -> list[tuple[str, float]]:
        """(neighbour, seconds waited) to report now, each at most once per `key`."""
        if self.timeout_s is None or now - started < self.timeout_s:
            return []
        phase, round_no = key
        self.told = {t for t in self.told if t[0] != phase or t[1] >= round_no}
        out = []
        for peer in sorted(set(awaited)):
            if (phase, round_no, peer) not in self.told:
                self.told.add((phase, round_no, peer))
                out.append((peer, now - started))
        return out
