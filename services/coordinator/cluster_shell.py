"""The cluster core's shell: feeds it what arrived and carries its commands out.

`cluster.apply` decides who is in the cluster and what becomes of people's
requests; `Cluster` holds its state, turns a heartbeat, a hello, a probe answer
or a request into an event, and does what the core asks: replies, Redis writes
(a device's record with the wall clock's time, a job's record, its state
through an outage), a job's check (the model built in a child process), the
reads a submission needs, log lines. Each effect's answer goes back to the core
as an event, in the same call, so a request is answered before the next message
is read. The state's fields are what the coordinator's runs and tests read and set.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from common.checkpoint import latest_round
from common.errors import ConfigError, StoreError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import CancelJob, DrainDevice, Message, SubmitJob
from common.records.devices import forget_devices, write_device
from common.records.documents import put_jobspec
from common.records.jobs import index_job, job_state, read_job, write_job, write_job_state
from common.secrets import mask_text
from common.serving_messages import InferRequest, ServeModel
from common.settings import CoordinatorSettings
from common.store import OUTAGE, REFUSED, Store
from services.coordinator import cluster, job_records
from services.coordinator.checks import check_job
from services.coordinator.cluster_state import (
    DEVICE_WRITE_EVERY_S,
    CancelIn,
    CheckJob,
    CheckServe,
    ClusterLimits,
    ClusterState,
    Command,
    DeviceUnrecorded,
    DrainIn,
    Event,
    ForgetDevices,
    InferIn,
    JobChecked,
    JobLookedUp,
    JobRefused,
    JobRegistered,
    Log,
    LookUpJob,
    RegisterJob,
    RegisterServe,
    Reply,
    ServeChecked,
    ServeIn,
    SubmitIn,
    WriteDevice,
    WriteState,
)
from services.coordinator.membership import Members, Rules, dead
from services.coordinator.model_probe import probe_limits
from services.coordinator.writes import Writes

__all__ = ["ClientRequest", "Cluster", "StateField"]

log = get_logger(__name__)
ClientRequest = SubmitJob | CancelJob | DrainDevice | ServeModel | InferRequest
"""What a person may ask the coordinator."""


T = TypeVar("T")


class HasCluster(Protocol):
    """What holds a cluster shell (the coordinator)."""

    cluster: Cluster


class StateField(Generic[T]):
    """An attribute of the cluster shell's holder that is a field of the core's state.

    Read and set like a plain attribute (`coord.members`, `coord.running = jid`):
    a set replaces the state with one whose field is the new value.
    """

    def __init__(self, field: str | None = None) -> None:
        self.field = field or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, holder: HasCluster, owner: Any = None) -> T:
        value: T = getattr(holder.cluster.state, self.field)
        return value

    def __set__(self, holder: HasCluster, value: T) -> None:
        holder.cluster.set(**{self.field: value})


def limits_of(settings: CoordinatorSettings) -> ClusterLimits:
    """The cluster's rules under `settings`.

    A device is never forgotten before it would be declared dead: a job waiting
    on it must see it dead, not absent.
    """
    dead_s = settings.heartbeat_s * settings.heartbeat_misses
    expiry_s = max(settings.device_expiry_s, dead_s)
    return ClusterLimits(Rules(DEVICE_WRITE_EVERY_S, expiry_s, settings.max_unassigned_devices))


class Cluster:
    """The cluster core's state, fed events, with its commands carried out."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: Store,
        writes: Writes,
        send: Callable[[DeviceId, Message], None],
    ) -> None:
        self.settings, self.store, self.writes, self.send = settings, store, writes, send
        self.state = ClusterState(limits=limits_of(settings))
        """The core's state; the running job's shell takes cancels, drains, the next
        queued job and inference requests out of its containers."""

    def feed(self, event: Event, now: float) -> None:
        """Step the core with `event` at `now`, then with each answer of the effects it asked."""
        pending: deque[Event] = deque([event])
        while pending:
            self.state, commands = cluster.apply(self.state, pending.popleft(), now)
            for cmd in commands:
                answer = self._carry_out(cmd)
                if answer is not None:
                    pending.append(answer)

    def request(self, peer: DeviceId, msg: ClientRequest, now: float) -> None:
        """A person's request, answered with a JobReply (an InferReply only when refused)."""
        event: Event
        if isinstance(msg, SubmitJob):
            event = SubmitIn(peer, msg.job, msg.replace)
        elif isinstance(msg, CancelJob):
            event = CancelIn(peer, msg.job_id, msg.reason)
        elif isinstance(msg, DrainDevice):
            event = DrainIn(peer, msg.target, msg.reason)
        elif isinstance(msg, ServeModel):
            event = ServeIn(peer, msg.spec)
        else:
            event = InferIn(peer, msg)
        self.feed(event, now)

    def alive(self, now: float) -> Members:
        """Workers whose heartbeats are current."""
        s, members = self.settings, self.state.members
        gone = set(dead(members, now, s.heartbeat_s, s.heartbeat_misses))
        return {d: m for d, m in members.items() if d not in gone}

    def take_cancel(self, jid: str) -> str | None:
        """Why job `jid` was cancelled, taken out of the state; None if it was not."""
        reason = self.state.cancelled.get(jid)
        if reason is not None:
            rest = {j: r for j, r in self.state.cancelled.items() if j != jid}
            self.state = replace(self.state, cancelled=rest)
        return reason

    def set(self, **fields: object) -> None:
        """Set fields of the state the runs own (the job slot) or the tests set."""
        self.state = replace(self.state, **fields)  # type: ignore[arg-type]

    # --- the effects -----------------------------------------------------------------

    def _carry_out(self, cmd: Command) -> Event | None:
        """Do what the core asked; the answer it awaits, if any."""
        if isinstance(cmd, Reply):
            self.send(cmd.peer, cmd.msg)
        elif isinstance(cmd, Log):
            getattr(log, cmd.level)(cmd.event, **cmd.fields)
        elif isinstance(cmd, WriteDevice):
            try:
                write_device(self.store, cmd.hb, seen=time.time(), ttl_s=cmd.ttl_s)
            except (*OUTAGE, *REFUSED):  # the next heartbeat's write a second later catches up
                return DeviceUnrecorded(cmd.hb.device)
        elif isinstance(cmd, ForgetDevices):
            # exact keys, one per device: never a pattern built from a peer's name
            gone = list(cmd.devices)
            self.writes.write_soon(
                "forget silent devices", lambda: forget_devices(self.store, gone)
            )
        elif isinstance(cmd, WriteState):
            write = partial(write_job_state, self.store, cmd.job_id, cmd.state, **cmd.fields)
            self.writes.write_soon(f"job {cmd.job_id} {cmd.state}", write)
        elif isinstance(cmd, LookUpJob):
            try:
                state = job_state(self.store, cmd.job_id) or "unknown"
            except OUTAGE:
                state = "unknown while Redis is unreachable"
            return JobLookedUp(cmd.peer, cmd.job_id, state)
        elif isinstance(cmd, CheckJob | RegisterJob):
            return self._submission(cmd)
        else:
            return self._serving(cmd)
        return None

    def _submission(self, cmd: CheckJob | RegisterJob) -> Event:
        """Check a job and read its id's record, or register it; a failure says why."""
        peer = cmd.peer
        jid = cmd.job.job_id if isinstance(cmd, CheckJob) else cmd.checked.job_id
        try:
            if isinstance(cmd, RegisterJob):
                job_records.register(self.store, cmd.checked, cmd.forget_old)
                return JobRegistered(peer, cmd.checked)
            checked = check_job(cmd.job, self.settings.model_modules, probe_limits(self.settings))
            state = job_state(self.store, jid)
            held = job_records.existing(self.store, jid)
            committed = _committed(self.store, jid) if held else 0
            return JobChecked(peer, checked, cmd.replace, state, held, committed)
        except ConfigError as exc:
            return JobRefused(peer, jid, str(exc))
        except OUTAGE as exc:
            error = (
                f"Redis at {self.store.where} is unreachable ({mask_text(str(exc))}): nothing "
                f"was queued; submit job {jid} again once it is back"
            )
            return JobRefused(peer, jid, error)
        except Exception as exc:  # a job must not take the coordinator down; say what broke
            log.exception("job check failed", job=jid, by=peer)
            return JobRefused(peer, jid, f"job {jid} from {peer} cannot be checked: {exc!r}")

    def _serving(self, cmd: CheckServe | RegisterServe) -> Event:
        """Read a serving job's id's state, or record the job (`kind: serve`)."""
        store, spec = self.store, cmd.spec
        jid = spec.serve_id
        try:
            if isinstance(cmd, CheckServe):
                return ServeChecked(cmd.peer, spec, job_state(store, jid))
            put_jobspec(store, jid, spec.model_dump(mode="json"))
            write_job(store, jid, state="submitted", submitted=time.time(), kind="serve")
            index_job(store, jid)
            return JobRegistered(cmd.peer, spec)
        except OUTAGE as exc:
            error = f"Redis at {store.where} is unreachable ({mask_text(str(exc))})"
            return JobRefused(cmd.peer, jid, error)
        except REFUSED as exc:
            error = str(store.refusal(exc, f"recording serving job {jid}"))
            return JobRefused(cmd.peer, jid, error)


def _committed(store: Store, jid: str) -> int | None:
    """Rounds job `jid`'s earlier run committed: its record's or its newest checkpoint's.

    None when either is unreadable (written by no coordinator): the earlier run
    is then kept, as one that ran would be.
    """
    try:
        record = read_job(store, jid)
        latest = latest_round(store, jid)
    except (StoreError, ValueError, TypeError):
        return None
    return max(0 if record is None else record.round or 0, latest or 0)
