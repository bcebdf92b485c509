"""The detection timeouts in force: what the loop measures in, `timeouts.derive` out.

The shell half of `timeouts`: it watches the heartbeats the cluster took (a
device's beat count moving is one arrival), each probe's round trip and each
committed round's time, keeps them in the pure `Observed` windows, and derives
the timeouts the next wait uses (`effective`), the settings being upper bounds.
The running job's are written to Redis (`timeouts:<job>`) when they change, at
most once a second, so `asteroid status` shows what is in force.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import replace

from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Assign, Message
from common.records.detection import put_effective
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator import timeouts
from services.coordinator.job_state import Run
from services.coordinator.membership import Members
from services.coordinator.timeouts import Bounds, Effective, Observed

__all__ = ["PROBES_TRACKED", "WRITE_EVERY_S", "InForce"]

log = get_logger(__name__)
WRITE_EVERY_S = 1.0
"""Least time between two writes of a job's timeouts record."""
PROBES_TRACKED = 256
"""Probes whose send time is kept for their round trip (the oldest go beyond)."""


class InForce:
    """The observations, the effective timeouts derived from them, and their record."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: Store,
        write_soon: Callable[[str, Callable[[], object]], None],
    ) -> None:
        self.store, self.write_soon = store, write_soon
        self.bounds = Bounds.of(settings)
        self.observed = Observed()
        self.effective: Effective = timeouts.derive(self.bounds, self.observed)
        self._beats: dict[DeviceId, int] = {}
        """Each watched device's beat count when last looked at: a change is an arrival."""
        self._probes: OrderedDict[tuple[DeviceId, int], float] = OrderedDict()
        """(device, nonce) of each probe sent, and when."""
        self._written: tuple[str, Effective] | None = None
        self._written_at = float("-inf")

    def beats(self, members: Members, among: Collection[DeviceId]) -> None:
        """Note the heartbeats of `among` (all devices when empty) that arrived since last time."""
        watched = {d: m for d, m in members.items() if not among or d in among}
        obs = self.observed
        for d, m in watched.items():
            if self._beats.get(d) != m.beats:
                obs = timeouts.observe_beat(obs, d, m.last_seen)
        for d in set(self._beats) - set(watched):  # left, or no longer the job's
            obs = timeouts.forget(obs, d)
        self._beats = {d: m.beats for d, m in watched.items()}
        self.observed = obs

    def probe_sent(self, device: DeviceId, nonce: int, now: float) -> None:
        """Probe `nonce` went to `device` at `now`."""
        self._probes[(device, nonce)] = now
        while len(self._probes) > PROBES_TRACKED:
            self._probes.popitem(last=False)

    def probe_answered(self, device: DeviceId, nonce: int, now: float) -> None:
        """`device` answered probe `nonce` at `now`: its round trip counts (if it was ours)."""
        sent = self._probes.pop((device, nonce), None)
        if sent is not None:
            self.observed = timeouts.observe_rtt(self.observed, device, now - sent)

    def round_done(self, seconds: float) -> None:
        """A round was committed `seconds` after it started."""
        self.observed = timeouts.observe_round(self.observed, seconds)

    def new_plan(self, predicted_round_s: float | None) -> None:
        """A plan took over: earlier rounds' times no longer say what a round takes."""
        self.observed = timeouts.on_plan(self.observed, predicted_round_s)

    def refresh(self, job_id: str | None, now: float) -> Effective:
        """The timeouts in force now; the running job's record is written if they changed."""
        eff = timeouts.derive(self.bounds, self.observed)
        if eff != self.effective:
            log.debug("detection timeouts changed", **_fields(eff))
        self.effective = eff
        due = now - self._written_at >= WRITE_EVERY_S
        if job_id is not None and due and self._written != (job_id, eff):
            self._written, self._written_at = (job_id, eff), now
            self.write_soon(
                f"job {job_id}'s timeouts", lambda: put_effective(self.store, job_id, eff)
            )
        return eff

    def follow(self, before: Run | None, after: Run) -> Run:
        """`after` with the timeouts in force as its limits, having noted its new rounds.

        The rounds `after` committed since `before` (their times) and a plan
        that took over feed the observations; the job core's next wait takes
        the limits in force when it begins.
        """
        if before is None or after.plan is not before.plan:
            self.new_plan(after.plan.predicted_round_s)
        done = len(before.summary.round_s) if before is not None else len(after.summary.round_s)
        for seconds in after.summary.round_s[done:]:
            self.round_done(seconds)
        eff, lim = self.effective, after.limits
        limits = replace(
            lim,
            heartbeat_deadline_s=eff.heartbeat_deadline_s,
            probe_timeout_s=eff.probe_timeout_s,
            flap_grace_s=eff.flap_grace_s,
        )
        return after if limits == lim else replace(after, limits=limits)

    def stamped(self, msg: Message) -> Message:
        """`msg`, an Assign with the neighbour timeout in force (others as they are)."""
        if not isinstance(msg, Assign):
            return msg
        return msg.model_copy(update={"peer_timeout_s": self.effective.peer_timeout_s})


def _fields(eff: Effective) -> dict[str, object]:
    return {
        "heartbeat_deadline_s": round(eff.heartbeat_deadline_s, 3),
        "probe_timeout_s": round(eff.probe_timeout_s, 3),
        "flap_grace_s": round(eff.flap_grace_s, 3),
        "peer_timeout_s": round(eff.peer_timeout_s, 3),
    }
