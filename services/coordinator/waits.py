"""What the loop reads (`events`), and the few waits that happen outside it.

`events` is how the coordinator's one loop sees the network: it pumps the socket
once and yields the membership, the peers whose control connection closed,
replica reports, replies, probe answers and neighbours' liveness reports (a
`PeerDown` becomes a signal naming its reporter) and a tick, for the running
job's shell to feed its core; on the way it feeds the timeouts in force
(`in_force`) what it saw. The blocking waits below
(`request_plan`: a plan asked of the planner before the loop starts, for
`--plan planner:NAME`; `wait_for_devices` and `gather`, which tests use to drive
workers step by step) keep serving the socket while they wait, and judge silent
and hung devices by `core.apply`'s rules, exactly as a job's steps do.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from common.errors import ConfigError, PlanError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import (
    Message,
    PeerDown,
    PlanReply,
    PlanRequest,
    Probe,
    ProbeReply,
    ReplicaSaved,
)
from common.plan import Plan
from common.profile import ClusterSpec
from common.records.documents import put_plan
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.cluster_shell import Cluster
from services.coordinator.control import ControlSocket
from services.coordinator.core import (
    Beats,
    Complete,
    Disconnected,
    Event,
    Fail,
    Heard,
    Log,
    Lost,
    PeerSilent,
    ProbeAnswer,
    Reconnected,
    Refused,
    Reply,
    SendProbe,
    Tick,
    apply,
    begin,
)
from services.coordinator.detection import COORDINATOR, Suspects
from services.coordinator.in_force import InForce
from services.coordinator.membership import Members, heard
from services.coordinator.outcomes import DeviceLost, JobCancelled, JobFailed
from services.coordinator.port_check import PortChecks
from services.coordinator.prepare_steps import PLANNER
from services.coordinator.writes import Writes

__all__ = ["REPLICA_NEWS_MAX", "Waits"]

log = get_logger(__name__)
REPLICA_NEWS_MAX = 1_000
"""Replica reports kept for the running job between two rounds."""


class Waits:
    """What the coordinator waits for, and the inbox of replies those waits read."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: Store,
        control: ControlSocket,
        cluster: Cluster,
        writes: Writes,
        pump: Callable[[float], None],
    ) -> None:
        self.settings, self.store, self.control, self.cluster = settings, store, control, cluster
        self.writes, self.pump = writes, pump
        self.inbox: deque[tuple[DeviceId, Message]] = deque()
        """Replies no request handler took, in arrival order, for the wait or job reading them."""
        self.replica_news: deque[ReplicaSaved] = deque(maxlen=REPLICA_NEWS_MAX)
        """Replicas reported complete since the running job last looked (bounded: a
        flood pushes out the oldest, and the job only trusts ones its plan names)."""
        self.collecting = False
        """A wait or a running job reads the inbox: probe answers go there too."""
        self._next_nonce = 1
        """The nonce of the next probe; never reused while this coordinator lives."""
        self.timeouts = InForce(settings, store, writes.write_soon)
        """The detection timeouts in force, derived from what the loop sees."""
        self.suspects: Suspects = {}
        """Suspects of `gather`'s waits, kept from one to the next (a job keeps its own)."""
        self.port_checks = PortChecks()
        """Data ports checked when a control connection closes: a refusal means no process."""

    def check_cancelled(self, jid: str) -> None:
        """Raise JobCancelled if someone cancelled job `jid`."""
        reason = self.cluster.take_cancel(jid)
        if reason is not None:
            raise JobCancelled(reason)

    def wait_for_devices(self, devices: list[DeviceId], timeout_s: float) -> None:
        """Block until every device in `devices` has sent a heartbeat.

        `devices` are the running job's: from now on they are exempt from
        expiry and from the cap on unassigned devices.
        """
        self.cluster.set(assigned=frozenset(devices))
        deadline = time.monotonic() + timeout_s
        while missing := [d for d in devices if d not in self.cluster.state.members]:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"workers {missing} did not join within {timeout_s:g} s "
                    f"(joined: {sorted(self.cluster.state.members)})"
                )
            self.pump(0.1)

    def alive(self) -> Members:
        """Workers whose heartbeats are current."""
        return self.cluster.alive(time.monotonic())

    def cluster_base(self) -> ClusterSpec | None:
        """The cluster spec file given with --cluster-spec, if any."""
        path: Path | None = self.settings.cluster_spec
        if path is None:
            return None
        try:
            return ClusterSpec.model_validate(yaml.safe_load(path.read_text()))
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(f"cluster spec {path} is invalid: {exc}") from exc

    def request(
        self,
        service: str,
        msg: Message,
        match: Callable[[Message], bool],
        timeout_s: float,
        what: str,
    ) -> Any:
        """Send `msg` to a service and wait for the first reply `match` accepts."""
        self.control.send(DeviceId(service), msg)
        deadline = time.monotonic() + timeout_s
        while True:
            for _ in range(len(self.inbox)):
                peer, got = self.inbox.popleft()
                if peer == service and match(got):
                    return got
                self.inbox.append((peer, got))
            if self.cluster.state.running:
                self.check_cancelled(self.cluster.state.running)
            if time.monotonic() > deadline:
                raise JobFailed(f"{service} did not send the {what} within {timeout_s:g} s")
            self.pump(0.1)

    def events(self, poll_s: float = 0.05) -> Iterator[Event]:
        """What happened since the last look, as events for a wait's or a job's core.

        Pumps the socket once, then yields the membership, the control
        connections that closed (each starts a check of the device's data port,
        whose refusal comes back as `Refused` in a later call), each replica
        report and inbox message (probe answers and neighbours' reports among
        them), and a tick. Messages are
        taken from the inbox one at a time: what a caller leaves after a verdict
        stays there, in order, for the next step. Callers set `collecting` while
        they read events, so that probe answers come this way too.
        """
        self.pump(poll_s)
        now, state = time.monotonic(), self.cluster.state
        self.timeouts.beats(state.members, state.assigned)
        eff = self.timeouts.refresh(state.running, now)
        self.control.hold_s = eff.flap_grace_s  # down longer: lost, its commands stale
        yield Beats(state.members)
        while self.control.closed:
            peer, at = self.control.closed.popleft()
            if (member := state.members.get(peer)) is not None:
                self.port_checks.check(peer, member.info.data_addr)
            yield Disconnected(peer, COORDINATOR, at)
        for peer, at in self.port_checks.take():
            yield Refused(peer, at)
        while self.replica_news:
            news = self.replica_news.popleft()
            yield Reply(news.device, news)
        for _ in range(len(self.inbox)):
            peer, msg = self.inbox.popleft()
            if isinstance(msg, ProbeReply):
                self.timeouts.probe_answered(peer, msg.nonce, now)
                yield ProbeAnswer(peer, msg.nonce)
            elif isinstance(msg, PeerDown):
                yield signal_of(peer, msg, now)
            else:
                yield Reply(peer, msg)
        yield Tick()

    def carry_out(self, cmd: SendProbe | Heard | Log) -> None:
        """Do what a wait's core asked: probe a suspect, count an answer as heard, log."""
        if isinstance(cmd, SendProbe):
            log.warning(
                "probing suspect",
                device=cmd.device,
                silent_s=round(cmd.silent_s, 2),
                nonce=cmd.nonce,
            )
            self.timeouts.probe_sent(cmd.device, cmd.nonce, time.monotonic())
            self.control.send(cmd.device, Probe(nonce=cmd.nonce))
        elif isinstance(cmd, Heard):
            self.cluster.set(members=heard(self.cluster.state.members, cmd.device, cmd.at))
        else:
            getattr(log, cmd.level)(cmd.event, **cmd.fields)

    def gather(
        self,
        kind: type[Message],
        devices: list[DeviceId],
        epoch: int,
        round_no: int,
        timeout_s: float,
        watchdog_s: float | None = None,
    ) -> dict[DeviceId, Any]:
        """Wait for one `kind` reply of (epoch, round) from each of `devices`, outside a job.

        The rules are `core.apply`'s, fed by `events`, exactly as a job's
        steps are (`driver`): a device whose heartbeats are overdue is probed;
        one that leaves the probe unanswered is lost; with `watchdog_s`, one
        that heartbeats without progress for that long is lost as hung.

        Raises:
            DeviceLost: Devices of `devices` are dead or hung.
            JobFailed: A device reported an error, or the replies took over `timeout_s`.

        """
        eff = self.timeouts.effective
        wait = begin(
            kind,
            devices,
            epoch,
            round_no,
            time.monotonic(),
            timeout_s,
            eff.heartbeat_deadline_s,
            eff.probe_timeout_s,
            watchdog_s,
            self.cluster.state.members,
            self.cluster.state.probes,
            self._next_nonce,
            suspects=self.suspects,
            flap_grace_s=eff.flap_grace_s,
        )
        self.collecting = True
        try:
            while not wait.done:
                for event in self.events():
                    wait, commands = apply(wait, event, time.monotonic())
                    self.cluster.set(probes=wait.probes)
                    self._next_nonce, self.suspects = wait.next_nonce, wait.suspects
                    for cmd in commands:
                        if isinstance(cmd, Lost):
                            raise DeviceLost(cmd.devices, cmd.reason)
                        if isinstance(cmd, Fail):
                            raise JobFailed(cmd.reason)
                        if isinstance(cmd, Complete):
                            return dict(cmd.replies)
                        self.carry_out(cmd)
            return {}
        finally:
            self.collecting = False

    def request_plan(self, req: PlanRequest, timeout_s: float) -> Plan:
        """Ask the planner service for a plan for job `req.job_id`, and record it."""
        plan = self.request_scored_plan(req, timeout_s)[0]
        self.writes.durable("storing the plan", lambda: put_plan(self.store, req.job_id, plan))
        return plan

    def request_scored_plan(self, req: PlanRequest, timeout_s: float) -> tuple[Plan, float]:
        """`request_plan`, and the planner's prediction of `req.current` (0: none)."""
        deadline = time.monotonic() + timeout_s
        while PLANNER not in self.cluster.state.services:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"no planner service joined within {timeout_s:g} s (start asteroid-planner "
                    f"with --coordinator {self.control.endpoint})"
                )
            if self.cluster.state.running:
                self.check_cancelled(self.cluster.state.running)
            self.pump(0.1)
        reply: PlanReply = self.request(
            PLANNER,
            req,
            lambda m: isinstance(m, PlanReply) and m.job_id == req.job_id,
            max(0.0, deadline - time.monotonic()),
            what="plan",
        )
        if not reply.ok or reply.plan is None:
            raise PlanError(f"planner {req.planner!r} failed: {reply.error or 'no plan sent'}")
        return reply.plan, reply.current_round_s


def signal_of(peer: DeviceId, msg: PeerDown, now: float) -> Disconnected | Reconnected | PeerSilent:
    """A neighbour's report as the core's signal: `peer` (its sender) is the reporter.

    The core checks it against the running plan and epoch (`detection.refusal`).
    """
    if msg.how == "disconnected":
        return Disconnected(msg.peer, peer, now, msg.epoch)
    if msg.how == "reconnected":
        return Reconnected(msg.peer, peer, msg.epoch)
    return PeerSilent(msg.peer, peer, msg.waited_s, msg.epoch)
