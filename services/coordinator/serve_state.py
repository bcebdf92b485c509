"""A serving job's core state, the events it takes and the commands it gives (`serve_core`).

Plain frozen data, as `job_state` is for training: `serve_core.apply` returns a
new `Serve` and a list of commands for every event; the shell
(`serving.ServeRun`) carries the commands out and answers some of them with
events. The requests themselves wait in the coordinator's fair queue, which
people's requests fill; the core sees it as a snapshot (`Waiting`), decides
what has waited too long and what cannot be answered, and asks for the next
one in fair order (`TakeRequest`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.ids import DeviceId
from common.messages import Message
from common.serving_messages import (
    InferChunk,
    InferReply,
    InferRequest,
    ServeSpec,
    TransformerShape,
)
from services.coordinator import core
from services.coordinator.core import (
    Beats,
    Heard,
    Log,
    ProbeAnswer,
    Reply,
    SendProbe,
    Signalled,
    Tick,
    Wait,
)
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned
from services.coordinator.membership import Members, Probes

__all__ = [
    "ENDED",
    "JOIN_TIMEOUT_S",
    "LOAD_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "Answer",
    "AppendMetrics",
    "Broke",
    "Command",
    "Drop",
    "Event",
    "InFlight",
    "Limits",
    "Out",
    "Phase",
    "ReadShape",
    "Recovery",
    "Serve",
    "ShapeRead",
    "TakeRequest",
    "Taken",
    "Waiting",
    "begin_step",
    "profile_sizes",
    "refusal",
]

JOIN_TIMEOUT_S = 60.0
"""How long the devices of a serving job get to be heard from."""
LOAD_TIMEOUT_S = 300.0
"""How long profiling, or loading a shard, may take on every device."""
REQUEST_TIMEOUT_S = 600.0
"""Longest one request may run on the devices."""

Phase = Literal["joining", "reading", "profiling", "loading", "serving", "cancelled", "failed"]
"""Where the job is. Planning has no phase: the planners are pure, so a plan is made
in the step that takes the last profile, before the shards are sent."""
ENDED = ("cancelled", "failed")


def refusal(config: TransformerConfig, msg: InferRequest) -> str | None:
    """Why the served model cannot answer `msg` (it is refused, the job goes on), or None."""
    if msg.new_tokens and config.kind != "decoder":
        return "only a decoder generates tokens; this model is an encoder"
    bad = [t for t in msg.ids if not 0 <= t < config.vocab_size]
    if bad:
        return f"token ids must be in [0, {config.vocab_size}), got {bad[:5]}"
    if len(msg.ids) + msg.new_tokens > config.max_positions:
        return (
            f"{len(msg.ids)} tokens plus {msg.new_tokens} to generate exceed the model's "
            f"{config.max_positions} positions"
        )
    return None


def profile_sizes(total: int, points: int = 4) -> list[int]:
    """Partition sizes to time a block at: `points` sizes spread over 1..total."""
    sizes = {max(1, round(total * (i + 1) / points)) for i in range(points)}
    return sorted(sizes)


# --- state --------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What bounds the job's waits: the coordinator's liveness settings and the steps' own."""

    heartbeat_deadline_s: float
    """Silence longer than this (heartbeat interval times misses) makes a suspect."""
    probe_timeout_s: float
    join_timeout_s: float = JOIN_TIMEOUT_S
    load_timeout_s: float = LOAD_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S


@dataclass(frozen=True)
class InFlight:
    """The request running on the devices: which, its number, when it was sent."""

    req: PendingRequest
    number: int
    started: float
    generated: tuple[int, ...] = ()
    """Tokens generated so far (from InferenceProgress), over every run of the request."""
    resumed: int = 0
    """Of `generated`, how many the current run took as prompt (a re-run after a loss)."""
    streamed: int = 0
    """Tokens already sent to a streaming requester: a re-run from the start sends no
    token twice."""


@dataclass(frozen=True)
class Recovery:
    """A loss the job is recovering from: recorded with the first answer after it."""

    lost: tuple[DeviceId, ...]
    silent_since: float
    """When the lost devices were last heard from: the loss counts from here."""
    declared: float
    """When they were declared lost."""
    reason: str


@dataclass(frozen=True)
class Serve:
    """A serving job: its devices, the step under way, the request running, what waits."""

    spec: ServeSpec
    limits: Limits
    epoch: int
    """Tells this job's replies from any earlier job's."""
    devices: tuple[DeviceId, ...]
    """The job's devices: those asked to join, less any lost, plus any taken in since
    (the plan may use fewer: `local` uses one)."""
    started: float
    """When the job began: the join deadline counts from here."""
    phase: Phase = "joining"
    shape: TransformerShape | None = None
    config: TransformerConfig | None = None
    plan: InferencePlan | None = None
    profiles: Mapping[str, BlockProfile] = field(default_factory=dict)
    """Every device's block timings, kept so a loss or a join is re-planned without profiling."""
    recovery: Recovery | None = None
    """A device loss whose recovery has not answered a request yet."""
    gone: Mapping[DeviceId, float] = field(default_factory=dict)
    """Devices lost, and when: one heard from after that may join again."""
    replanning: bool = False
    size: int = 0
    """Devices the job started with: workers it never had may fill places lost up to this."""
    """The shards being loaded take in devices that joined (not a loss)."""
    wait: Wait | None = None
    """The wait for the current step's replies (profiles, shards, a request's answer)."""
    members: Members = field(default_factory=dict)
    probes: Probes = field(default_factory=dict)
    next_nonce: int = 1
    running: InFlight | None = None
    waiting: tuple[PendingRequest, ...] = ()
    """The queue as last seen, less what the core took or refused since."""
    taking: bool = False
    """A TakeRequest is out and not answered yet."""
    requests: int = 0
    """Requests sent to the devices so far (each one's number)."""
    cancel: str | None = None
    """A cancel that arrived while a request ran: the job ends once it is answered."""
    outcome: str = ""
    """Why the job ended."""

    @property
    def ended(self) -> bool:
        """Cancelled or failed: only the requests still queued are answered now."""
        return self.phase in ENDED


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """The requests in the coordinator's queue now, in the queue's order."""

    requests: tuple[PendingRequest, ...]


@dataclass(frozen=True)
class Taken:
    """The request the fair queue gave for TakeRequest (None: it was empty)."""

    request: PendingRequest | None


@dataclass(frozen=True)
class ShapeRead:
    """The served shape, read from the checkpoint of round `round`."""

    shape: TransformerShape
    round: int


@dataclass(frozen=True)
class Broke:
    """The shell could not carry out a command (Redis, a checkpoint): the job fails."""

    error: str


Event = (
    Reply | Beats | ProbeAnswer | Tick | Signalled | Cancelled | Waiting | Taken | ShapeRead | Broke
)


# --- commands -----------------------------------------------------------------


@dataclass(frozen=True)
class ReadShape:
    """Read the served shape from training job `job`'s checkpoint; answered with ShapeRead."""

    job: str
    round: int | None


@dataclass(frozen=True)
class TakeRequest:
    """Take the next request from the queue, in fair order; answered with Taken."""


@dataclass(frozen=True)
class Drop:
    """Remove these requests from the queue: they are answered without being run."""

    requests: tuple[PendingRequest, ...]


@dataclass(frozen=True)
class Answer:
    """Send `reply` (or a streamed request's chunk of tokens) to the requester `peer`."""

    peer: DeviceId
    reply: InferReply | InferChunk


@dataclass(frozen=True)
class AppendMetrics:
    """Append `entry` to the job's metrics stream, now or once Redis is back."""

    what: str
    entry: Mapping[str, Any]


Command = (
    Send
    | Record
    | SetAssigned
    | ReadShape
    | TakeRequest
    | Drop
    | Answer
    | AppendMetrics
    | SendProbe
    | Heard
    | Log
)

Out = tuple[Serve, list[Command]]


def begin_step(
    serve: Serve,
    kind: type[Message],
    devices: list[DeviceId],
    round_no: int,
    now: float,
    timeout_s: float,
    watch: Sequence[DeviceId] = (),
) -> Serve:
    """Start waiting for one `kind` reply of (epoch, round_no) from each of `devices`.

    `watch` are devices that send no reply but whose loss ends the step too.
    """
    lim = serve.limits
    wait = core.begin(
        kind,
        devices,
        serve.epoch,
        round_no,
        now,
        timeout_s,
        lim.heartbeat_deadline_s,
        lim.probe_timeout_s,
        None,
        serve.members,
        serve.probes,
        serve.next_nonce,
        frozenset(watch),
    )
    return replace(serve, wait=wait)
