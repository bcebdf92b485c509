"""The cluster core's state, events and commands (`cluster.apply` decides on them).

The state is who is in the cluster (members, open probes, releases, services),
the queue of checked jobs and serving specs, the cancels and drains the running
job has not taken yet, and the job slot (running, federated, assigned). Events
are what arrived (a heartbeat, a hello, a person's request) and the answers of
effects the core asked for (a job checked, a record read or written); commands
are the effects: replies, Redis writes, a job's check, log lines.

The state is a frozen value whose containers the core never changes in place:
every change builds new ones, so a state `apply` returned stays as it was. The
running job's shell takes a cancel, a drain, the next queued job or an
inference request out of the current state's containers (its own effect).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.ids import DeviceId
from common.job import JobSpec
from common.messages import Heartbeat, Message
from common.serving_messages import InferRequest, ServeSpec
from common.version import VERSION
from services.coordinator.checked import CheckedJob
from services.coordinator.core import Log
from services.coordinator.fair_queue import FairQueue
from services.coordinator.infer_requests import PendingRequest, infer_queue
from services.coordinator.membership import Members, Probes, Rules, Verdict

__all__ = [
    "DEVICE_RECORD_GRACE_S",
    "DEVICE_WRITE_EVERY_S",
    "CancelIn",
    "CheckJob",
    "CheckServe",
    "ClusterLimits",
    "ClusterState",
    "Command",
    "DeviceUnrecorded",
    "DrainIn",
    "Event",
    "ForgetDevices",
    "HeartbeatIn",
    "HelloIn",
    "InferIn",
    "JobChecked",
    "JobLookedUp",
    "JobRefused",
    "JobRegistered",
    "Log",
    "LookUpJob",
    "ProbeAnswerIn",
    "Queued",
    "RegisterJob",
    "RegisterServe",
    "Reply",
    "ServeChecked",
    "ServeIn",
    "SubmitIn",
    "Sweep",
    "WriteDevice",
    "WriteState",
    "fresh_counts",
]

DEVICE_WRITE_EVERY_S = 1.0
"""Least time between two Redis writes of one device's heartbeat state."""
DEVICE_RECORD_GRACE_S = 10.0
"""A device's Redis record outlives its last heartbeat write by the expiry time plus this:
renewed while it heartbeats, gone soon after it (or the coordinator) stops."""

Queued = CheckedJob | ServeSpec
"""A job waiting to run: a training job (checked) or a serving job."""


def fresh_counts() -> dict[Verdict | str, int]:
    """Heartbeats by what became of them, devices forgotten, device writes Redis missed."""
    return {v: 0 for v in Verdict} | {"expired": 0, "unrecorded": 0}


@dataclass(frozen=True)
class ClusterLimits:
    """What the cluster's rules are: heartbeat costs and expiry, and the coordinator's release."""

    rules: Rules = field(default_factory=lambda: Rules(DEVICE_WRITE_EVERY_S))
    version: str = VERSION
    """The coordinator's release: a worker on another one is warned of once."""

    @property
    def record_ttl_s(self) -> float:
        """How long a device's Redis record outlives its write: it goes with its sender."""
        return self.rules.expiry_s + DEVICE_RECORD_GRACE_S

    @property
    def sweep_every_s(self) -> float:
        """Least time between two looks for silent devices."""
        return min(1.0, self.rules.expiry_s / 4)


@dataclass(frozen=True)
class ClusterState:
    """Who is in the cluster, what waits to run, and what runs now."""

    limits: ClusterLimits = field(default_factory=ClusterLimits)
    members: Members = field(default_factory=dict)
    probes: Probes = field(default_factory=dict)
    """Probes sent to suspects and not answered yet."""
    versions: Mapping[DeviceId, str] = field(default_factory=dict)
    """The release each member last reported, so another release is warned of once."""
    services: dict[str, float] = field(default_factory=dict)
    """Each service's name and when its last hello came (monotonic seconds)."""
    queue: deque[Queued] = field(default_factory=deque)
    """Jobs waiting to run, training (checked) and serving, in arrival order."""
    infer_queue: FairQueue[PendingRequest] = field(default_factory=infer_queue)
    """Inference requests for the running serving job, waiting their turn."""
    cancelled: dict[str, str] = field(default_factory=dict)
    """Jobs under way someone cancelled, and why; the job takes it at its next step."""
    drains: dict[DeviceId, str] = field(default_factory=dict)
    """Devices of the running job to drain, and why (at most the job's own devices)."""
    running: str | None = None
    """The job running now (one at a time), if any."""
    federated: str | None = None
    """A federated job being run, whose local pieces are `running` in turn."""
    assigned: frozenset[DeviceId] = frozenset()
    """Devices the running job's plan names: never forgotten nor capped while it runs."""
    counts: dict[Verdict | str, int] = field(default_factory=fresh_counts)
    """Heartbeats by what became of them, devices forgotten, and device writes Redis
    missed during an outage; logged when they change."""
    logged_counts: Mapping[Verdict | str, int] = field(default_factory=fresh_counts)
    """The counts as last logged."""
    next_sweep: float = 0.0
    """When silent devices are looked for next."""

    @property
    def keep(self) -> frozenset[DeviceId]:
        """Devices exempt from expiry and the cap: the running job's, none between jobs."""
        return self.assigned if self.running else frozenset()

    def queued(self, jid: str) -> bool:
        """Whether job `jid` waits in the queue."""
        return any(q.job_id == jid for q in self.queue)


# --- events ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatIn:
    """A worker's heartbeat arrived."""

    hb: Heartbeat


@dataclass(frozen=True)
class ProbeAnswerIn:
    """A suspect answered a probe while no wait nor job reads the answers."""

    device: DeviceId
    nonce: int


@dataclass(frozen=True)
class HelloIn:
    """A service announced itself (it may be asked for plans or profiles)."""

    service: str
    peer: str


@dataclass(frozen=True)
class Sweep:
    """Time passed: forget silent devices, log the counters that changed."""


@dataclass(frozen=True)
class DeviceUnrecorded:
    """A device's record could not be written (Redis is out); the next heartbeat catches up."""

    device: DeviceId


@dataclass(frozen=True)
class SubmitIn:
    """A person submitted a training job (`replace`: delete an earlier run of its id)."""

    peer: DeviceId
    job: JobSpec
    replace: bool = False


@dataclass(frozen=True)
class JobChecked:
    """`CheckJob`'s answer: the job passed, and what Redis holds for its id.

    `state` is the id's recorded state (None: none); `held` what the id already
    holds at all (its state, or "checkpointed", "recorded"; None: nothing);
    `committed` the rounds an earlier run committed, by its record or its
    newest checkpoint (None: not known).
    """

    peer: DeviceId
    checked: CheckedJob
    replace: bool
    state: str | None
    held: str | None
    committed: int | None = None


@dataclass(frozen=True)
class ServeIn:
    """A person submitted a serving job."""

    peer: DeviceId
    spec: ServeSpec


@dataclass(frozen=True)
class ServeChecked:
    """`CheckServe`'s answer: the serving job's id and its recorded state (None: none)."""

    peer: DeviceId
    spec: ServeSpec
    state: str | None


@dataclass(frozen=True)
class JobRegistered:
    """A job's record was written (`RegisterJob`, `RegisterServe`): it may be queued."""

    peer: DeviceId
    job: Queued


@dataclass(frozen=True)
class JobRefused:
    """A submission failed in an effect (its check, a Redis read or write), and why."""

    peer: DeviceId
    job_id: str
    error: str


@dataclass(frozen=True)
class CancelIn:
    """A person cancelled a job."""

    peer: DeviceId
    job_id: str
    reason: str


@dataclass(frozen=True)
class JobLookedUp:
    """`LookUpJob`'s answer: the state of a job that is neither queued nor running."""

    peer: DeviceId
    job_id: str
    state: str


@dataclass(frozen=True)
class DrainIn:
    """A person asked to drain a device of the running job."""

    peer: DeviceId
    target: DeviceId
    reason: str


@dataclass(frozen=True)
class InferIn:
    """A person sent an inference request for a serving job."""

    peer: DeviceId
    msg: InferRequest


Event = (
    HeartbeatIn
    | ProbeAnswerIn
    | HelloIn
    | Sweep
    | DeviceUnrecorded
    | SubmitIn
    | JobChecked
    | ServeIn
    | ServeChecked
    | JobRegistered
    | JobRefused
    | CancelIn
    | JobLookedUp
    | DrainIn
    | InferIn
)


# --- commands ----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Send `msg` (a JobReply or an InferReply) to `peer`."""

    peer: DeviceId
    msg: Message


@dataclass(frozen=True)
class WriteDevice:
    """Write a device's heartbeat to its Redis record, which expires after `ttl_s`."""

    hb: Heartbeat
    ttl_s: float


@dataclass(frozen=True)
class ForgetDevices:
    """Delete the Redis records of devices forgotten (soon, if Redis is out)."""

    devices: tuple[DeviceId, ...]


@dataclass(frozen=True)
class CheckJob:
    """Check a submitted job (its model built in a child process) and read its id's record.

    Answered by `JobChecked`, or `JobRefused` with what is wrong.
    """

    peer: DeviceId
    job: JobSpec
    replace: bool


@dataclass(frozen=True)
class CheckServe:
    """Read the record of a serving job's id; answered by `ServeChecked` or `JobRefused`."""

    peer: DeviceId
    spec: ServeSpec


@dataclass(frozen=True)
class RegisterJob:
    """Record a checked job as submitted (`forget_old`: delete an earlier run of its id first).

    Answered by `JobRegistered`, or `JobRefused` when Redis did not take it.
    """

    peer: DeviceId
    checked: CheckedJob
    forget_old: bool


@dataclass(frozen=True)
class RegisterServe:
    """Record a serving job as submitted; answered by `JobRegistered` or `JobRefused`."""

    peer: DeviceId
    spec: ServeSpec


@dataclass(frozen=True)
class WriteState:
    """Write a job's state and `fields` to its record and events (soon, if Redis is out)."""

    job_id: str
    state: str
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LookUpJob:
    """Read a job's state to say why it cannot be cancelled; answered by `JobLookedUp`."""

    peer: DeviceId
    job_id: str


Command = (
    Reply
    | WriteDevice
    | ForgetDevices
    | CheckJob
    | CheckServe
    | RegisterJob
    | RegisterServe
    | WriteState
    | LookUpJob
    | Log
)
