"""A federated home's decisions as a pure function: `apply(home, event, now)`.

A home joins its federation, then fetches the model to start from, trains a
piece (`rounds` local rounds as a job of its own), sends the result, and
fetches again, until the federation says it is done. Every decision of that
conversation is made here, from the state and one event at a time: which
request to send, when to send it again (every `RESEND_S` without an answer:
each request is safe to repeat), when the federation has been silent too long
(the spec's `timeout_s`), how long to wait when told to, what a refusal or a
stale update means, and how a cancel ends the job (a piece under way is
cancelled too, and the job ends once it has). The shell (`federated.FederatedRun`)
owns the federation's DEALER, the data, Redis and the piece; it decodes the
federation's answers into events and keeps their tensors: the core names a
received model by its round and a piece's trained model by the piece's number.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.job import JobSpec
from common.lifecycle import JobState, advance
from services.coordinator.core import Log
from services.coordinator.job_state import Cancelled, Record
from services.coordinator.job_state import Event as JobEvent

__all__ = [
    "ENDED",
    "MIN_WAIT_S",
    "RESEND_S",
    "Answer",
    "Ask",
    "Broke",
    "CancelPiece",
    "Command",
    "DataRead",
    "Event",
    "Home",
    "Out",
    "Phase",
    "PieceBroke",
    "PieceDone",
    "ReadData",
    "Request",
    "SendFederation",
    "StartPiece",
    "apply",
    "start",
]

RESEND_S = 5.0
"""How long a home waits for an answer before sending its request again."""
MIN_WAIT_S = 0.05
"""The shortest wait before fetching again when the federation says wait."""
MIN_LATENCY_S = 1e-6
"""A piece's reported latency is at least this (the wire refuses zero)."""

Phase = Literal[
    "reading",
    "joining",
    "fetching",
    "waiting",
    "piece",
    "updating",
    "finished",
    "failed",
    "cancelled",
]
ENDED = ("finished", "failed", "cancelled")

Request = JoinFederation | FetchModel | HomeUpdate


# --- state --------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """A request to the federation awaiting its answer: when to resend it, when to give up."""

    msg: Request
    answer: type[FederationReply] | type[FederatedModel]
    attach: int | None
    """The piece whose trained model travels with the request (an update), if any."""
    resend_at: float
    deadline: float


@dataclass(frozen=True)
class Home:
    """One home's part in its federation: where the conversation stands."""

    job_id: str
    federation: str
    address: str
    home: int
    job: JobSpec
    """The job (its model spec travels in the join)."""
    timeout_s: float
    lifecycle: JobState = "submitted"
    phase: Phase = "reading"
    num_samples: int = 0
    ask: Ask | None = None
    until: float = 0.0
    """The end of a wait the federation asked for (phase "waiting")."""
    asked: float = 0.0
    """When the fetch of the current piece was sent: its latency counts the download."""
    round_id: int = -1
    status: str = ""
    """The fetch's answer the current piece trains for ("train" or "probe")."""
    pieces: int = 0
    """Pieces started: piece N runs as job ``<job>.r<N>``."""
    latency_s: float = 0.0
    cancel: str | None = None
    """A cancel that arrived during a piece: the job ends once the piece has."""
    outcome: str = ""
    """Why the job ended (failed or cancelled)."""

    @property
    def ended(self) -> bool:
        """Finished, failed or cancelled: no event changes it any more."""
        return self.phase in ENDED

    @property
    def due(self) -> float | None:
        """The next time the core has something to decide without news (None: nothing)."""
        if self.ended:
            return None
        if self.phase == "waiting":
            return self.until
        if self.ask is not None:
            return min(self.ask.resend_at, self.ask.deadline)
        return None


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class DataRead:
    """The home's training data (ReadData): its size and label histogram."""

    num_samples: int
    histogram: tuple[int, ...]


@dataclass(frozen=True)
class Answer:
    """A message from the federation (its tensors stay with the shell)."""

    msg: FederationReply | FederatedModel


@dataclass(frozen=True)
class PieceDone:
    """Piece `number` trained its rounds; its model is ready to send."""

    number: int
    local_accuracy: float
    """Its last held-out accuracy (-1: it evaluated nothing)."""


@dataclass(frozen=True)
class PieceBroke:
    """Piece `number` ended without a model: it failed, or was cancelled."""

    number: int
    reason: str
    cancelled: bool = False


@dataclass(frozen=True)
class Broke:
    """One of the shell's effects failed (the data cannot be read, say): the job fails."""

    reason: str


Event = DataRead | Answer | PieceDone | PieceBroke | Broke | JobEvent
"""What the core takes; a job's other events (a tick, heartbeats, a worker's message) are
time passing to it (a piece under way takes them from the shell)."""


# --- commands -----------------------------------------------------------------


@dataclass(frozen=True)
class ReadData:
    """Read the job's training data; answered with DataRead (or Broke)."""


@dataclass(frozen=True)
class SendFederation:
    """Send `msg` to the federation, with piece `attach`'s model as its frame if given.

    `fresh`: a new request, so answers still queued for the previous one are
    out of date and dropped first; a resend keeps them.
    """

    msg: Request
    attach: int | None = None
    fresh: bool = True


@dataclass(frozen=True)
class StartPiece:
    """Train piece `number` from the model received for `round_id`; answered by its end."""

    number: int
    round_id: int


@dataclass(frozen=True)
class CancelPiece:
    """Cancel piece `number` (under way); it still ends with PieceDone or PieceBroke."""

    number: int
    reason: str


Command = Record | Log | ReadData | SendFederation | StartPiece | CancelPiece
Out = tuple[Home, list[Command]]


# --- the core -----------------------------------------------------------------


def start(job: JobSpec, now: float) -> Out:
    """A home of `job`'s federation: record it running and read its data."""
    fed = job.federation
    if fed is None:
        raise ValueError(f"job {job.job_id} has no federation section")
    home = Home(
        job_id=job.job_id,
        federation=fed.federation_id,
        address=fed.address,
        home=fed.home,
        job=job,
        timeout_s=fed.timeout_s,
    )
    fields = {"federation": home.federation, "home": str(home.home)}  # the record's text field
    home, record = _record(home, "running", fields)
    return home, [record, ReadData()]


def apply(home: Home, event: Event, now: float) -> Out:
    """The home after `event` at `now`, and what the shell must do."""
    if home.ended:
        return home, []
    if isinstance(event, Cancelled):
        return _cancel(home, event.reason)
    if isinstance(event, Broke):
        return _end(home, "failed", event.reason)
    if isinstance(event, DataRead) and home.phase == "reading":
        home = replace(home, num_samples=event.num_samples)
        join = JoinFederation(
            federation=home.federation,
            home=home.home,
            model=home.job.model,
            num_samples=event.num_samples,
            histogram=list(event.histogram),
        )
        return _send(replace(home, phase="joining"), join, FederationReply, now)
    if isinstance(event, PieceDone | PieceBroke):
        return _piece_ended(home, event, now)
    if isinstance(event, Answer):
        return _answer(home, event.msg, now)
    return _time(home, now)


def _time(home: Home, now: float) -> Out:
    """Time passed: end a wait, resend an unanswered request, or give up on it."""
    if home.phase == "waiting":
        return _fetch(home, now) if now >= home.until else (home, [])
    ask = home.ask
    if ask is None:
        return home, []
    if now >= ask.deadline:
        return _end(
            home,
            "failed",
            f"the federation at {home.address} did not answer the {ask.msg.type} within "
            f"{home.timeout_s:g} s",
        )
    if now > ask.resend_at:  # a restarted federation lost the request
        home = replace(home, ask=replace(ask, resend_at=now + RESEND_S))
        return home, [SendFederation(ask.msg, ask.attach, fresh=False)]
    return home, []


def _answer(home: Home, msg: FederationReply | FederatedModel, now: float) -> Out:
    """The federation answered: the awaited answer moves the home on; others change nothing.

    A refusal fails the job, except a stale one (an update whose round had closed).
    """
    ask = home.ask
    if ask is None:
        home, out = _time(home, now)
        return home, [Log("debug", "federation answer not awaited", {"type": msg.type}), *out]
    if isinstance(msg, FederationReply) and not msg.ok and not msg.stale:
        return _end(home, "failed", f"the federation refused the {ask.msg.type}: {msg.error}")
    if not isinstance(msg, ask.answer):  # an answer to an earlier request: out of date
        return _time(home, now)
    home = replace(home, ask=None)
    if isinstance(msg, FederatedModel):
        return _model(home, msg, now)
    if home.phase == "joining":
        return _fetch(home, now)
    logs: list[Command] = []
    if not msg.ok:  # stale: its round had closed; the next fetch says what now
        logs.append(Log("warning", "update came after its round closed", {"error": msg.error}))
    logs.append(
        Log(
            "info",
            "home update sent",
            {
                "piece": home.pieces,
                "round_id": home.round_id,
                "status": home.status,
                "latency_s": round(home.latency_s, 3),
                "version": msg.version,
            },
        )
    )
    home, more = _fetch(home, now)
    return home, [*logs, *more]


def _model(home: Home, task: FederatedModel, now: float) -> Out:
    """The fetch's answer: end, wait, or train a piece from the model received."""
    if task.status == "done":
        if home.pieces == 0:
            return _end(
                home, "failed", f"the federation {home.federation} ended before this home trained"
            )
        return _end(home, "finished", "")
    if task.status == "wait":
        return replace(home, phase="waiting", until=now + max(task.wait_s, MIN_WAIT_S)), []
    number = home.pieces
    home = replace(
        home, phase="piece", pieces=number + 1, round_id=task.round_id, status=task.status
    )
    return home, [StartPiece(number, task.round_id)]


def _piece_ended(home: Home, event: PieceDone | PieceBroke, now: float) -> Out:
    """A piece ended: send its model, or end the job as the piece (or a cancel) says."""
    if home.phase != "piece" or event.number != home.pieces - 1:
        return home, [Log("debug", "end of a piece not under way", {"piece": event.number})]
    if isinstance(event, PieceBroke):
        if event.cancelled:
            return _end(home, "cancelled", home.cancel or event.reason)
        return _end(home, "failed", event.reason)
    if home.cancel is not None:
        return _end(home, "cancelled", home.cancel)
    latency = max(now - home.asked, MIN_LATENCY_S)
    home = replace(home, phase="updating", latency_s=latency)
    update = HomeUpdate(
        federation=home.federation,
        home=home.home,
        round_id=home.round_id,
        num_samples=home.num_samples,
        latency_s=latency,
        local_accuracy=event.local_accuracy,
    )
    return _send(home, update, FederationReply, now, attach=event.number)


def _cancel(home: Home, reason: str) -> Out:
    """Cancelled: at once, or once the piece under way has stopped."""
    if home.phase != "piece":
        return _end(home, "cancelled", reason)
    if home.cancel is not None:
        return home, []
    return replace(home, cancel=reason), [CancelPiece(home.pieces - 1, reason)]


def _fetch(home: Home, now: float) -> Out:
    """Ask for the model to train from next (the piece's latency starts here)."""
    fetch = FetchModel(federation=home.federation, home=home.home)
    return _send(replace(home, phase="fetching", asked=now), fetch, FederatedModel, now)


def _send(
    home: Home,
    msg: Request,
    answer: type[FederationReply] | type[FederatedModel],
    now: float,
    attach: int | None = None,
) -> Out:
    ask = Ask(msg, answer, attach, resend_at=now + RESEND_S, deadline=now + home.timeout_s)
    return replace(home, ask=ask), [SendFederation(msg, attach)]


def _record(home: Home, to: JobState, fields: Mapping[str, object]) -> tuple[Home, Record]:
    """Move the job's lifecycle to `to` (the transition table decides) and say so."""
    return replace(home, lifecycle=advance(home.lifecycle, to)), Record(to, fields)


def _end(home: Home, phase: Literal["finished", "failed", "cancelled"], reason: str) -> Out:
    if phase == "finished":
        fields: dict[str, object] = {"pieces": home.pieces}
    else:
        fields = {"error" if phase == "failed" else "reason": reason}
    home, record = _record(home, phase, fields)
    return replace(home, phase=phase, outcome=reason, ask=None), [record]
