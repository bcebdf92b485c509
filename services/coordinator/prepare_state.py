"""The preparation core's state, the events it takes and the commands it gives (`prepare`).

Plain frozen data, like `job_state` for the training core: `prepare.apply`
returns a new `Prep` and a list of commands for every event; the shell
(`jobs.JobRun`) carries the commands out and answers some of them with events
(`ReadProfiles` with `ProfilesRead`, `ReadClusterBase` with `ClusterBaseRead`,
`MeasureLink` with `LinkAsked`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from common.ids import DeviceId
from common.job import JobSpec
from common.messages import MeasureLinks, ProfileRequest
from common.plan import Plan
from common.profile import ClusterSpec
from services.coordinator.core import Beats, Log, ProbeAnswer, Reply, Tick
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned, StorePlan
from services.coordinator.membership import Members

__all__ = [
    "PREP_ENDED",
    "Asking",
    "Challenge",
    "ClusterBaseRead",
    "Command",
    "Event",
    "ForgetLink",
    "LinkAsked",
    "MeasureLink",
    "Measuring",
    "NoteWaiting",
    "Out",
    "Prep",
    "PrepLimits",
    "PrepPhase",
    "ProfileFacts",
    "ProfilesRead",
    "ReadClusterBase",
    "ReadProfiles",
    "Services",
    "StoreCluster",
    "StoreLinks",
    "fail",
]

PrepPhase = Literal[
    "workers",
    "vetting",
    "profiling",
    "links",
    "planning",
    "devices",
    "ready",
    "failed",
    "cancelled",
]
PREP_ENDED = ("ready", "failed", "cancelled")


@dataclass(frozen=True)
class PrepLimits:
    """The coordinator's settings that bound preparation's waits."""

    join_timeout_s: float
    probe_timeout_s: float
    profile_timeout_s: float
    plan_timeout_s: float
    heartbeat_s: float
    heartbeat_misses: int
    link_probe_bytes: int
    link_probe_timeout_s: float
    link_bandwidth: float
    endpoint: str = ""
    """Where the coordinator listens, named when no planner joins."""

    @property
    def fresh_service_s(self) -> float:
        """A profiler heard from within this long is asked (ten heartbeat deadlines)."""
        return 10 * self.heartbeat_s * self.heartbeat_misses

    @property
    def settle_s(self) -> float:
        """A job without `min_workers` starts once its vetted workers stayed the same this long.

        Four heartbeat intervals: a worker that is up is heard from within one,
        so one that joins along with the others is not left behind.
        """
        return 4 * self.heartbeat_s


@dataclass(frozen=True)
class Challenge:
    """A challenge (Probe with a negative nonce) sent to a device not yet vetted."""

    nonce: int
    sent_at: float


@dataclass(frozen=True)
class ProfileFacts:
    """What a stored profile says that preparation needs: its sizes and memory budget."""

    batch_sizes: tuple[int, ...]
    memory_budget: int


@dataclass(frozen=True)
class Asking:
    """A profile request outstanding for one kind of device."""

    request: ProfileRequest
    device: DeviceId
    """The first worker of that kind, named in errors."""
    profilers: tuple[str, ...] | None = None
    """The profilers to ask in turn (None: none heard of yet)."""
    at: int = 0
    """Index in `profilers` of the one asked now."""
    deadline: float = 0.0
    """When the profiler asked now has not answered in time (or, before any is known,
    when the wait for a profiler ends)."""
    tried: tuple[str, ...] = ()
    """Profilers that said the device is of another kind."""
    late: tuple[str, ...] = ()
    """Why profilers that did not answer in time failed, in order."""


@dataclass(frozen=True)
class Measuring:
    """A link measurement asked of `prober` (its request, sent), awaited until `deadline`."""

    prober: DeviceId
    target: DeviceId
    request: MeasureLinks | None = None
    deadline: float = 0.0


@dataclass(frozen=True)
class Prep:
    """One preparation: the devices, their profiles and links, the planner's plan."""

    job: JobSpec
    layers: int
    limits: PrepLimits
    replan: bool
    """A running job's re-plan: no lifecycle records, no plan stored, no wait for devices."""
    phase: PrepPhase = "workers"
    deadline: float = 0.0
    """When the phase's own wait ends (workers, vetting, planning, devices)."""
    members: Members = field(default_factory=dict)
    """The latest heartbeats of every known device (the shell's snapshot)."""
    services: Mapping[str, float] = field(default_factory=dict)
    """Services heard from, and when (monotonic seconds)."""
    chosen: Members = field(default_factory=dict)
    """The vetted devices being prepared (from profiling on)."""
    proven: frozenset[DeviceId] = frozenset()
    refused: Mapping[DeviceId, str] = field(default_factory=dict)
    challenges: Mapping[DeviceId, Challenge] = field(default_factory=dict)
    next_challenge: int = -1
    """The nonce of the next challenge; challenges count down, suspects' probes up."""
    waiting_logged: tuple[DeviceId, ...] | None = None
    """The vetted devices the last "waiting for workers" line named."""
    vetted_since: float = 0.0
    """When the vetted devices last changed (a job without `min_workers` settles from it)."""
    keys: Mapping[DeviceId, str] = field(default_factory=dict)
    """Each chosen device's profile key (as far as known)."""
    todo: tuple[Asking, ...] = ()
    """Kinds of device still to profile; the first is asked now."""
    profiled: tuple[str, ...] = ()
    budgets: Mapping[str, int] = field(default_factory=dict)
    reading: Literal["cache", "budgets", None] = None
    base: ClusterSpec | None = None
    pairs: tuple[tuple[DeviceId, DeviceId], ...] = ()
    """Pairs still to measure; the first is measured now."""
    measuring: Measuring | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    link_errors: Mapping[str, str] = field(default_factory=dict)
    measured: bool = False
    """The links were measured (not given by the cluster spec)."""
    cluster: ClusterSpec | None = None
    current: Plan | None = None
    slowdowns: Mapping[DeviceId, float] = field(default_factory=dict)
    asked_planner: bool = False
    plan: Plan | None = None
    current_s: float = 0.0
    """The planner's prediction of `current`'s round on the new cluster (0: none)."""
    outcome: str = ""
    """Why preparation failed or was cancelled."""
    config: bool = False
    """The failure is the person's to fix (a spec, a setting, the planner's refusal)."""

    @property
    def ended(self) -> bool:
        """Ready, failed or cancelled: no event changes it any more."""
        return self.phase in PREP_ENDED


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Services:
    """The services the shell knows, and when each last said hello."""

    known: Mapping[str, float]


@dataclass(frozen=True)
class ProfilesRead:
    """The stored profiles under the keys asked (None: none, or not a valid profile)."""

    found: Mapping[str, ProfileFacts | None]


@dataclass(frozen=True)
class ClusterBaseRead:
    """The cluster spec file given to the coordinator, if any."""

    base: ClusterSpec | None


@dataclass(frozen=True)
class LinkAsked:
    """The shell sent `request` (its nonce now awaited) to `prober`."""

    prober: DeviceId
    request: MeasureLinks


Event = (
    Beats
    | Reply
    | ProbeAnswer
    | Tick
    | Cancelled
    | Services
    | ProfilesRead
    | ClusterBaseRead
    | LinkAsked
)


# --- commands -----------------------------------------------------------------


@dataclass(frozen=True)
class ReadProfiles:
    """Read the stored profiles under `keys`; answered with ProfilesRead."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class ReadClusterBase:
    """Read the cluster spec file, if any; answered with ClusterBaseRead."""


@dataclass(frozen=True)
class MeasureLink:
    """Ask `prober` to measure its link to `target`'s sink at `addr`; answered with LinkAsked."""

    prober: DeviceId
    target: DeviceId
    addr: str


@dataclass(frozen=True)
class ForgetLink:
    """The answer to link measurement `nonce` of `prober` is no longer awaited."""

    prober: DeviceId
    nonce: int


@dataclass(frozen=True)
class StoreLinks:
    """Store the link matrix of `devices` (the shell adds when it was measured)."""

    devices: tuple[DeviceId, ...]
    links: Mapping[str, float]
    errors: Mapping[str, str]


@dataclass(frozen=True)
class NoteWaiting:
    """Write what the wait for workers has (`vetted`) and needs into the job's hash.

    No state change: the job stays submitted, and `asteroid status` and
    `train`'s progress show the wait while it lasts. `vetted` None clears it.
    """

    vetted: tuple[DeviceId, ...] | None
    need: int | None = None


@dataclass(frozen=True)
class StoreCluster:
    """Store `cluster` as the one the job is planned for."""

    cluster: ClusterSpec


Command = (
    Send
    | Record
    | Log
    | StorePlan
    | SetAssigned
    | ReadProfiles
    | ReadClusterBase
    | MeasureLink
    | ForgetLink
    | StoreLinks
    | StoreCluster
    | NoteWaiting
)


Out = tuple[Prep, list[Command]]


def fail(prep: Prep, reason: str, config: bool = False, out: Sequence[Command] = ()) -> Out:
    """Preparation ends failed; `config`: the person's to fix (a spec, a setting, a plan)."""
    return replace(prep, phase="failed", outcome=reason, config=config), list(out)
