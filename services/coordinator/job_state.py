"""The job core's state, the events it takes and the commands it gives (`driver`).

Plain frozen data: the core (`driver.apply`, with `recovering` for what follows
a loss) returns a new `Run` and a list of commands for every event; the shell
(`jobs.JobRun`) carries the commands out and answers some of them with events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from common.ids import DeviceId
from common.job import JobSpec
from common.lifecycle import JobState
from common.messages import Message
from common.plan import Plan
from services.coordinator import core
from services.coordinator.adapt import Speeds
from services.coordinator.core import Beats, Heard, Log, ProbeAnswer, Reply, SendProbe, Tick, Wait
from services.coordinator.detection import Suspects
from services.coordinator.job_limits import Limits
from services.coordinator.link_drift import CommWatch
from services.coordinator.membership import Members, Probes, watchdog_s
from services.coordinator.migration import Transfers
from services.coordinator.recovery import MemoryInputs
from services.coordinator.replicas import ReplicaBook
from services.coordinator.store_outage import StoreBack, StoreDown

__all__ = [
    "ENDED",
    "Append",
    "Cancelled",
    "Capacities",
    "CheckStore",
    "CheckpointFound",
    "Command",
    "CommitCheckpoint",
    "Drain",
    "EpochRaised",
    "Event",
    "Limits",
    "Out",
    "Phase",
    "PlanAgain",
    "PlanFailed",
    "PlanReady",
    "Publish",
    "RaiseEpoch",
    "ReadCapacities",
    "ReadCheckpoint",
    "Record",
    "Recovery",
    "RequestPlan",
    "Run",
    "Send",
    "SetAssigned",
    "StorePlan",
    "Summary",
    "begin_step",
    "fail",
    "known",
]

Phase = Literal[
    "assign",
    "round",
    "eval",
    "checkpoint",
    "collect",
    "recovering",
    "finished",
    "failed",
    "cancelled",
]
ENDED = ("finished", "failed", "cancelled")


# --- state --------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """What the job reported so far: per round, evaluations, checkpoints, recoveries."""

    start: int
    losses: tuple[float, ...] = ()
    accuracies: tuple[float, ...] = ()
    round_s: tuple[float, ...] = ()
    max_alive: Mapping[str, int] = field(default_factory=dict)
    peak_bytes: Mapping[str, int] = field(default_factory=dict)
    checkpoints: tuple[int, ...] = ()
    evals: tuple[tuple[int, float, float], ...] = ()
    recoveries: tuple[Mapping[str, Any], ...] = ()

    def rolled_back(self, to_round: int) -> Summary:
        """Forget what rounds `to_round` and later reported (they are replayed)."""
        keep = max(0, to_round - self.start)
        return replace(
            self,
            losses=self.losses[:keep],
            accuracies=self.accuracies[:keep],
            round_s=self.round_s[:keep],
            checkpoints=tuple(c for c in self.checkpoints if c <= to_round),
            evals=tuple(e for e in self.evals if e[0] <= to_round),
        )


@dataclass(frozen=True)
class Recovery:
    """A re-plan under way: a recovery from lost devices, or a device joining or draining.

    `kind` "recovery" follows a loss (`lost`); "join" takes in devices that
    registered while the job ran (`joining`); "drain" moves the work of
    `leaving` away; "adapt" moves partition points by measured speeds; "links"
    measures the links again and may move to the planner's plan on them. All
    but a recovery resume at the committed round: nothing is replayed.
    """

    lost: tuple[DeviceId, ...]
    reason: str
    failed_round: int
    started: float
    from_peers: bool
    """False after a loss during a recovery: devices may already hold their new layers,
    so only the Redis checkpoint is a version everyone can resume from."""
    version: int | None = None
    from_replicas: bool = False
    sizes: tuple[int, ...] | None = None
    plan: Plan | None = None
    moves: Transfers | None = None
    planned_at: float = 0.0
    moving_at: float = 0.0
    kind: Literal["recovery", "join", "drain", "adapt", "links"] = "recovery"
    speeds: tuple[float, ...] | None = None
    """The measured speeds an "adapt" re-partition was made for: its plan's baseline."""
    joining: tuple[DeviceId, ...] = ()
    leaving: tuple[DeviceId, ...] = ()


@dataclass(frozen=True)
class Run:
    """A running job: its plan and epoch, the step under way, what it committed."""

    job: JobSpec
    total: int
    layers: int
    train_size: int | None
    limits: Limits
    plan: Plan
    summary: Summary
    eval_samples: int = 0
    """Held-out samples one evaluation covers (0: as `eval_size` gives it for the job)."""
    phase: Phase = "assign"
    epoch: int = 0
    committed: int = 0
    """Rounds committed: the version the weights of a finished round belong to."""
    step: int = 0
    """The round a step is about (a round's number, an evaluation's or checkpoint's version)."""
    started: bool = False
    """The job reported `running` once (the first assignment is its start)."""
    from_peers: bool = False
    """The first assignment keeps the devices' own state (a coordinator restarted)."""
    wait: Wait | None = None
    members: Members = field(default_factory=dict)
    probes: Probes = field(default_factory=dict)
    suspects: Suspects = field(default_factory=dict)
    next_nonce: int = 1
    book: ReplicaBook | None = None
    recovery: Recovery | None = None
    cancel: str | None = None
    drains: Mapping[DeviceId, str] = field(default_factory=dict)
    """Devices to drain at the next round boundary, and why."""
    passed_over: frozenset[DeviceId] = frozenset()
    """Devices the planner was offered to join and left out: not offered again."""
    costs: tuple[float, ...] | None = None
    """Per-layer profiled costs (None: unknown, so measured speeds mean nothing)."""
    memory: MemoryInputs | None = None
    """The model's bytes and the devices' budgets, for re-partitions to respect."""
    speeds: Speeds = field(default_factory=Speeds)
    """Each stage's measured speed under the current plan."""
    replan_s: float | None = None
    """What this job's last re-plan took, the price of the next one."""
    watch: CommWatch = field(default_factory=CommWatch)
    """Rounds in a row that communicated far more than the plan predicted (`link_drift`)."""
    outcome: str = ""
    """Why the job ended (failed or cancelled)."""
    step_t0: float = 0.0
    outage: StoreDown | None = None
    """Redis is away: the shell holds a write and what follows it (`outages`)."""

    @property
    def ended(self) -> bool:
        """Finished, failed or cancelled: no event changes it any more."""
        return self.phase in ENDED


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Cancelled:
    """Someone cancelled the job; it stops at the next round boundary."""

    reason: str


@dataclass(frozen=True)
class Drain:
    """Someone asked to drain `device` at the next round boundary."""

    device: DeviceId
    reason: str


@dataclass(frozen=True)
class EpochRaised:
    """The shell raised the plan epoch in Redis (RaiseEpoch): the new assignment's epoch."""

    epoch: int


@dataclass(frozen=True)
class Capacities:
    """What a lightweight re-plan weighs layers and devices by, from the job's profiles.

    None where unknown (every layer and device then counts alike, memory is unchecked).
    """

    costs: Sequence[float] | None
    speeds: Mapping[DeviceId, float] | None
    memory: MemoryInputs | None


@dataclass(frozen=True)
class PlanReady:
    """The planner's plan for the survivors (heavy recovery), the joined or the re-measured.

    After PlanAgain, `current_s` is the running plan's round as the
    planner predicts it on the newly measured links (None: it could not say).
    """

    plan: Plan
    current_s: float | None = None


@dataclass(frozen=True)
class PlanFailed:
    """The planner could not plan for the survivors."""

    error: str


@dataclass(frozen=True)
class CheckpointFound:
    """The newest committed Redis checkpoint of the job, if any."""

    round: int | None


Event = (
    Reply
    | Beats
    | ProbeAnswer
    | Tick
    | core.Signalled
    | Cancelled
    | Drain
    | EpochRaised
    | Capacities
    | PlanReady
    | PlanFailed
    | CheckpointFound
    | StoreDown
    | StoreBack
)


# --- commands -----------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send `msg` to `device` on the control plane."""

    device: DeviceId
    msg: Message


@dataclass(frozen=True)
class Record:
    """Move the job to lifecycle state `state` in Redis, with `fields`."""

    state: JobState
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Publish:
    """Write the job's hash `fields`, a `metrics` entry and a `ledger` entry, durably.

    The shell adds the wall-clock time (`updated`) to the hash.
    """

    what: str
    fields: Mapping[str, Any]
    metrics: Mapping[str, Any]
    ledger: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Append:
    """Append `entry` to the job's stream `stream` ("events" or "ledger"), durably."""

    what: str
    stream: Literal["events", "ledger"]
    entry: Mapping[str, Any]


@dataclass(frozen=True)
class StorePlan:
    """Store `plan` as the job's plan."""

    plan: Plan


@dataclass(frozen=True)
class SetAssigned:
    """These devices run the job now: exempt from expiry and the cap on unassigned devices."""

    devices: frozenset[DeviceId]


@dataclass(frozen=True)
class RaiseEpoch:
    """Raise the plan epoch in Redis; answered with EpochRaised."""


@dataclass(frozen=True)
class CheckStore:
    """Wait until Redis answers (before leaders write a checkpoint)."""

    what: str


@dataclass(frozen=True)
class CommitCheckpoint:
    """Publish checkpoint `round` (all `layers` written) with the replicas' digests, if any."""

    round: int
    layers: int
    digests: tuple[Mapping[str, str], ...] | None
    version: int
    """Weight changes the checkpoint holds: its round in sync mode, more in async mode."""


@dataclass(frozen=True)
class ReadCapacities:
    """Read the job's profiles and budgets; answered with Capacities."""


@dataclass(frozen=True)
class ReadCheckpoint:
    """Find the newest committed checkpoint; answered with CheckpointFound."""


@dataclass(frozen=True)
class RequestPlan:
    """Profile and plan on `devices`; answered with PlanReady or PlanFailed."""

    devices: frozenset[DeviceId]


@dataclass(frozen=True)
class PlanAgain:
    """Plan `devices` again as they measure now; answered like RequestPlan.

    The links among them are measured again, and each device's profiled times
    are multiplied by its measured `slowdowns` (none: as profiled). The planner
    also predicts `current` (the running plan) on that cluster, so the core can
    tell whether moving is worth it (PlanReady.current_s).
    """

    devices: frozenset[DeviceId]
    current: Plan
    slowdowns: Mapping[DeviceId, float] = field(default_factory=dict)


Command = (
    Send
    | Record
    | Publish
    | Append
    | StorePlan
    | SetAssigned
    | RaiseEpoch
    | CheckStore
    | CommitCheckpoint
    | ReadCapacities
    | ReadCheckpoint
    | RequestPlan
    | PlanAgain
    | SendProbe
    | Heard
    | Log
)

Out = tuple[Run, list[Command]]
T = TypeVar("T")


def known(value: T | None, what: str) -> T:
    """`value`, which the core's own order of steps guarantees is set (else a bug)."""
    if value is None:
        raise RuntimeError(f"job core out of order: {what} is not set")
    return value


# --- helpers of both halves of the core -----------------------------------------


def begin_step(
    run: Run,
    kind: type[Message],
    step: int,
    now: float,
    watchdog: bool = True,
    devices: Sequence[DeviceId] | None = None,
) -> Run:
    """Start waiting for one `kind` reply of (run.epoch, step) from each plan device.

    With `devices`, from those only (heavy recovery's gather asks the layers' holders).
    """
    lim = run.limits
    return replace(
        run,
        step=step,
        step_t0=now,
        wait=core.begin(
            kind,
            list(run.plan.devices if devices is None else devices),
            run.epoch,
            step,
            now,
            lim.round_timeout_s,
            lim.heartbeat_deadline_s,
            lim.probe_timeout_s,
            watchdog_s(lim.hung_min_s, lim.hung_factor, run.plan.predicted_round_s)
            if watchdog
            else None,
            run.members,
            run.probes,
            run.next_nonce,
            suspects=run.suspects,
            flap_grace_s=lim.flap_grace_s,
        ),
    )


def fail(run: Run, reason: str, out: Sequence[Command] = ()) -> Out:
    """The job ends failed; the shell records why (as it does for its own errors)."""
    return replace(run, phase="failed", outcome=reason, wait=None), list(out)
