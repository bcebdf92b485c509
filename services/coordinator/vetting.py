"""Which known devices a plan may name: those whose claims hold and that answered a challenge.

A heartbeat costs nothing to send, and anyone on the LAN can send one that
copies a real worker's fingerprint: planned into a stage, such a device
takes the Assign (spec, plan, peers) and the job waits on it until its
round timeout. So before a device is planned it must (1) claim what its
fingerprint says (`claims.claim_problem`: the profile under that fingerprint
is what the planner believes, not the claim) and (2) answer a challenge sent
to it (a Probe with a fresh nonce, answered by a worker's control thread at
once) within the probe timeout. A device that fails either is left out with
a logged reason, never planned; one that answered once is not asked again
for the same job. Challenges use negative nonces, suspects' probes positive
ones, so a late answer to one is never taken for the other.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Collection, Iterator
from typing import Protocol

from common.errors import AsteroidError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Message, Probe, ProbeReply
from services.coordinator.claims import claim_problem
from services.coordinator.membership import Members

__all__ = ["Shell", "Vetting", "prove"]

log = get_logger(__name__)

_NONCES: Iterator[int] = itertools.count(-1, -1)


class Shell(Protocol):
    """What vetting needs of the coordinator: its socket, inbox, membership and clock."""

    inbox: deque[tuple[DeviceId, Message]]
    collecting: bool
    running: str | None

    def send(self, device: DeviceId, msg: Message) -> None: ...  # noqa: D102

    def pump(self, timeout_s: float) -> None: ...  # noqa: D102

    def alive(self) -> Members: ...  # noqa: D102

    def check_cancelled(self, jid: str) -> None: ...  # noqa: D102


def prove(shell: Shell, devices: Collection[DeviceId], timeout_s: float) -> set[DeviceId]:
    """Those of `devices` that answered a fresh challenge within `timeout_s`.

    Answers land in the inbox while `collecting` is set; other messages found
    there are left in order for whoever waits for them.
    """
    nonces = {d: next(_NONCES) for d in devices}
    for d, nonce in nonces.items():
        shell.send(d, Probe(nonce=nonce))
    answered: set[DeviceId] = set()
    was, shell.collecting = shell.collecting, True
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for _ in range(len(shell.inbox)):
                peer, msg = shell.inbox.popleft()
                if isinstance(msg, ProbeReply) and nonces.get(peer) == msg.nonce:
                    answered.add(peer)
                else:
                    shell.inbox.append((peer, msg))
            if len(answered) == len(nonces) or time.monotonic() > deadline:
                return answered
            shell.pump(0.05)
    finally:
        shell.collecting = was


class Vetting:
    """One job's vetting of devices: who answered (kept), who was left out and why (logged once)."""

    def __init__(self, shell: Shell, timeout_s: float) -> None:
        self.shell = shell
        self.timeout_s = timeout_s
        self.proven: set[DeviceId] = set()
        self.refused: dict[DeviceId, str] = {}

    def vetted(self, members: Members) -> Members:
        """The members a plan may name; the others are logged with the reason, once.

        A device vetted once stays vetted for the job: its heartbeats' thread
        count moves while a split stage runs lanes with their own counts.
        """
        claims = {
            d: None if d in self.proven else claim_problem(m.info) for d, m in members.items()
        }
        ask = [d for d, why in claims.items() if why is None and d not in self.proven]
        if ask:
            self.proven |= prove(self.shell, ask, self.timeout_s)
        unanswered = f"it did not answer a challenge within {self.timeout_s:g} s"
        out: Members = {}
        for d, m in members.items():
            why = claims[d] or (None if d in self.proven else unanswered)
            if why is None:
                out[d] = m
            elif self.refused.get(d) != why:
                self.refused[d] = why
                log.warning("device left out of the plan", device=d, reason=why)
        return out

    def wait(self, count: int, timeout_s: float) -> Members:
        """At least `count` vetted members, waiting up to `timeout_s` for them to join.

        Raises:
            AsteroidError: fewer joined and passed within `timeout_s` (names those left out).

        """
        deadline = time.monotonic() + timeout_s
        while True:
            members = self.vetted(self.shell.alive())
            if len(members) >= count:
                return members
            if time.monotonic() > deadline:
                left = {d: why for d, why in self.refused.items() if d not in members}
                raise AsteroidError(
                    f"min_workers: {count} workers wanted, {len(members)} joined and vetted "
                    f"within {timeout_s:g} s ({sorted(members)}; left out: {left or 'none'})"
                )
            if self.shell.running:
                self.shell.check_cancelled(self.shell.running)
            self.shell.pump(0.1)
