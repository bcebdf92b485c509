"""A home of a federation: the coordinator's federated job type, the shell of its core.

The job trains like any other, on this home's devices with its plan, but in pieces:
it joins the federation (`asteroid-federation`) with its sample count and label
histogram, then repeatedly fetches the model to start from, trains `rounds` local
rounds as a job of its own (``<job>.r<N>``: planned, checkpointed and recovered like
any job), and sends the resulting model with the time the piece took, its response
latency. The federation decides when the job ends. No sample ever leaves the home.

Every decision is `federated_core.apply`'s; `FederatedRun` carries its commands
out: it owns the DEALER to the federation (read without waiting whenever it is
fed an event), the data, Redis and the piece, and keeps the tensors the core
only names (the model received for a round, the model a piece trained).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import zmq
from torch import Tensor

from common.checkpoint import load_full_state
from common.codec import Limits, recv_message, send_message
from common.curve import COORDINATOR, load_keys
from common.errors import AsteroidError, ConfigError, ProtocolError
from common.federation_messages import FederatedModel, FederationReply
from common.fl.data import label_histogram
from common.fl.wire import state_frame, state_from_frame
from common.job import FederatedSpec, check_job_id
from common.job_data import open_data
from common.lifecycle import TERMINAL
from common.logging import get_logger
from common.messages import Message
from common.plan import Plan
from common.records.documents import read_plan
from common.sockets import connect_dealer
from common.zoo import build_model
from services.coordinator import federated_core
from services.coordinator.checks import CheckedJob
from services.coordinator.core import Log
from services.coordinator.federated_core import (
    Answer,
    Broke,
    CancelPiece,
    Command,
    DataRead,
    Event,
    Home,
    PieceBroke,
    PieceDone,
    ReadData,
    SendFederation,
    StartPiece,
)
from services.coordinator.host import Host
from services.coordinator.job_state import Cancelled, Record, known
from services.coordinator.job_state import Event as JobEvent
from services.coordinator.jobs import JobCancelled, JobFailed, JobRun, JobSummary

__all__ = ["FederatedRun", "FederationLink", "home_identity"]

log = get_logger(__name__)


def home_identity(home: int) -> str:
    """A home's routing identity, and the name of its key in the federation's key set."""
    return f"home-{home}"


class FederationLink:
    """One home's DEALER to the federation: requests out, answers read without waiting."""

    def __init__(self, spec: FederatedSpec) -> None:
        self.limits = Limits()
        name = home_identity(spec.home)
        keys = load_keys(spec.keys, "worker", name)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = connect_dealer(
            self.ctx,
            spec.address,
            name,
            keys=keys,
            server_key=keys.server_key("coordinator", COORDINATOR) if keys else None,
        )
        self.name = name

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(0)
        self.ctx.term()

    def send(self, msg: Message, tensors: list[Tensor], fresh: bool) -> None:
        """Send `msg` with `tensors`; a `fresh` request first drops answers still queued.

        Those answer requests sent before (resent ones answered twice, say): out of date.
        """
        while fresh and self.sock.poll(0, zmq.POLLIN):
            self.sock.recv_multipart()
        send_message(self.sock, msg, self.name, tensors)

    def received(self) -> Iterable[tuple[FederationReply | FederatedModel, list[Tensor]]]:
        """The federation's answers that have arrived, with their frames; never waits."""
        while self.sock.poll(0, zmq.POLLIN):
            try:
                _, env = recv_message(self.sock, self.limits)
            except ProtocolError as exc:
                log.warning("bad message from the federation", reason=exc.reason)
                continue
            if isinstance(env.msg, FederationReply | FederatedModel):
                yield env.msg, env.tensors
            else:
                log.warning("unexpected message from the federation", type=env.msg.type)


class FederatedRun:
    """Runs a job with a `federation` section as one home of that federation.

    Steppable: `begin()`, then `feed(event)` with each of the coordinator's
    events until `ended`, then `result()`, as the coordinator's one loop does.
    Each `feed` also reads what the federation sent and
    whether someone cancelled the job. A piece is a `JobRun` stepped the same
    way: while one is under way, every event fed here is fed to it too.
    """

    def __init__(self, coord: Host, checked: CheckedJob) -> None:
        job = checked.spec
        if job.federation is None:
            raise ConfigError(f"job {job.job_id} has no federation section")
        self.coord, self.checked, self.job, self.spec = coord, checked, job, job.federation
        self.jid = job.job_id
        self.model = build_model(job.model, job.seed, coord.settings.model_modules)
        self.plan: Plan | None = None
        """The plan the next piece runs on (None: profiled and planned)."""
        self.home: Home | None = None
        self.link: FederationLink | None = None
        self.received: tuple[int, list[Tensor]] | None = None
        """The model the federation sent last for a round to train (round id, frames)."""
        self.trained: tuple[int, dict[str, Tensor]] | None = None
        """The model the last piece trained (piece number, state)."""
        self.summary: JobSummary | None = None
        """The last piece's summary."""
        self.piece: tuple[int, JobRun] | None = None
        """The piece under way: its number and run."""
        self.error: AsteroidError | None = None
        """The error of the effect that failed the job, raised again by `result`."""
        self.reference: dict[str, Tensor] | None = None
        """The model's tensors, names and shapes a received model must have."""

    # --- the stepping API ---------------------------------------------------------

    @property
    def ended(self) -> bool:
        """Finished, failed or cancelled (recorded): `result` says how."""
        return self.home is not None and self.home.ended

    def begin(self, plan: Plan | None = None) -> None:
        """Record the job running, read its data and join; the first piece runs on `plan`."""
        self.plan = plan
        self.coord.federated = self.jid
        broke: Broke | None = None
        try:
            self.link = FederationLink(self.spec)
        except AsteroidError as exc:  # this home's keys: the job fails, recorded
            self.error, broke = exc, Broke(str(exc))
        with self._closing():
            self._carry_out(*federated_core.start(self.job, time.monotonic()))
            if broke is not None:
                self._step(broke)

    def feed(self, event: JobEvent) -> None:
        """Take `event`, what the federation sent meanwhile, and a cancel, if any.

        A piece under way takes the event too; its end is the core's next event.
        """
        if self.ended:
            return
        with self._closing():
            for msg, frames in known(self.link, "the federation link").received():
                if isinstance(msg, FederatedModel) and msg.status in ("train", "probe"):
                    self.received = (msg.round_id, frames)
                self._step(Answer(msg))
            if self.piece is not None:
                self.piece[1].feed(event)
                if self.piece[1].ended:
                    self._step(self._piece_ended())
            self._step(event)
            reason = self.coord.cancelled.pop(self.jid, None)
            if reason is not None:
                self._step(Cancelled(reason))

    def stop(self, reason: str) -> None:
        """The coordinator stops: the piece under way ends cancelled; this job stays as it was.

        Its record keeps its state, so that a restarted coordinator may take part
        in the federation again under the same job.
        """
        if self.piece is not None:  # the piece records its end
            self.piece[1].stop(reason)
        self._close()

    def result(self) -> JobSummary:
        """The last piece's summary once finished.

        Raises:
            JobFailed, JobCancelled, ConfigError: how the job ended (recorded already).

        """
        home = known(self.home, "the federated job's start")
        if home.phase == "finished":
            return known(self.summary, "a finished piece")
        if home.phase == "cancelled":
            raise JobCancelled(home.outcome)
        if home.phase == "failed":
            raise self.error if self.error is not None else JobFailed(home.outcome)
        raise RuntimeError(f"federated job {self.jid} has not ended ({home.phase})")

    @contextmanager
    def _closing(self) -> Iterator[None]:
        """Close the link when a step raises or ends the job."""
        try:
            yield
        except BaseException:
            self._close()
            raise
        if self.ended:
            self._close()

    def _close(self) -> None:
        """Give up the federation link and the coordinator's federated slot (once)."""
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.coord.federated == self.jid:
            self.coord.federated = None
        self.coord.cancelled.pop(self.jid, None)

    def _step(self, event: Event) -> None:
        if not self.ended:
            home = known(self.home, "the federated job's start")
            self._carry_out(*federated_core.apply(home, event, time.monotonic()))

    def _carry_out(self, home: Home, commands: list[Command]) -> None:
        """Do what the core asked, in order; feed it what a command answers."""
        self.home = home
        todo = deque(commands)
        while todo:
            answer = self._do(todo.popleft())
            if answer is not None:
                self.home, more = federated_core.apply(self.home, answer, time.monotonic())
                todo.extend(more)

    def _do(self, cmd: Command) -> Event | None:
        """Carry out one command; the event it answers with, if any."""
        if isinstance(cmd, Record):
            self._record(cmd)
        elif isinstance(cmd, Log):
            getattr(log, cmd.level)(cmd.event, **cmd.fields)
        elif isinstance(cmd, SendFederation):
            tensors = []
            if cmd.attach is not None:
                number, state = known(self.trained, "a trained piece")
                if number != cmd.attach:
                    raise RuntimeError(f"piece {cmd.attach}'s model is gone (kept: {number})")
                tensors = [state_frame(state)]
            known(self.link, "the federation link").send(cmd.msg, tensors, cmd.fresh)
        elif isinstance(cmd, CancelPiece):
            self.coord.cancelled[self._piece_id(cmd.number)] = cmd.reason
        elif isinstance(cmd, ReadData):
            return self._read_data()
        elif isinstance(cmd, StartPiece):
            return self._piece(cmd)
        return None

    def _record(self, cmd: Record) -> None:
        """Write a transition the core made (an end as soon as Redis answers)."""
        log.info("job state", state=cmd.state, **cmd.fields)
        write = partial(self.coord.write_state, self.jid, cmd.state, **cmd.fields)
        if cmd.state in TERMINAL:
            self.coord.write_soon(f"job {self.jid} {cmd.state}", write)
        else:
            self.coord.durable(f"recording job state {cmd.state}", write)

    def _read_data(self) -> DataRead | Broke:
        """The home's sample count and label histogram (never a sample)."""
        try:
            data = open_data(self.job, self.model)
            if data.train_size is None:
                raise ConfigError("a federated job needs a finite data set (digits, cifar10)")
            labels = data.train.labels(torch.arange(data.train_size, dtype=torch.int64))
        except AsteroidError as exc:
            self.error = exc
            return Broke(str(exc))
        histogram = label_histogram(labels, self.model.num_classes)
        return DataRead(data.train_size, tuple(histogram))

    def _piece_id(self, number: int) -> str:
        return check_job_id(f"{self.jid}.r{number}", f"federated job {self.jid}")

    def _piece(self, cmd: StartPiece) -> PieceDone | PieceBroke | None:
        """Start training `rounds` local rounds from the received model as ``<job>.r<N>``.

        Its end is an event of its own (`_piece_ended`), unless it ended at once.
        """
        try:
            run = self._begin_piece(cmd)
        except AsteroidError as exc:
            self.error = exc
            return PieceBroke(cmd.number, str(exc))
        self.piece = (cmd.number, run)
        return self._piece_ended() if run.ended else None

    def _piece_ended(self) -> PieceDone | PieceBroke:
        """The piece's end, with its trained model kept for the update."""
        number, run = known(self.piece, "a piece under way")
        self.piece = None
        try:
            summary = self._finish_piece(number, run)
        except JobCancelled as exc:
            return PieceBroke(number, str(exc), cancelled=True)
        except AsteroidError as exc:
            self.error = exc
            return PieceBroke(number, str(exc))
        accuracy = summary.evals[-1][2] if summary.evals else -1.0
        return PieceDone(number, accuracy)

    def _begin_piece(self, cmd: StartPiece) -> JobRun:
        coord, job, number = self.coord, self.job, cmd.number
        round_id, frames = known(self.received, "the federation's model")
        if round_id != cmd.round_id:
            raise RuntimeError(f"the model of round {cmd.round_id} is gone (kept: {round_id})")
        if self.reference is None:
            self.reference = self.model.full().state_dict()
        start = state_from_frame(frames, self.reference, "the federation")
        self.received = None
        if number > 0:  # the plan the last piece ended on, if all its devices are here
            self.plan = self._plan_of(self._piece_id(number - 1))
        piece_id = self._piece_id(number)
        piece = job.model_copy(
            update={"job_id": piece_id, "federation": None, "seed": job.seed + number + 1}
        )
        checked = self.checked.piece(piece)
        coord.durable(f"registering {piece_id}", lambda: coord.register(checked, forget_old=True))
        run = JobRun(coord, checked, initial=start)
        run.begin(self.plan)
        return run

    def _finish_piece(self, number: int, run: JobRun) -> JobSummary:
        """Its summary, once its model is read; only the newest piece's checkpoints stay."""
        coord, piece_id = self.coord, run.jid
        summary = run.result()
        state = coord.durable(
            f"reading the model of {piece_id}",
            lambda: load_full_state(coord.store, piece_id, run.total),
        )
        self.trained, self.summary = (number, state), summary
        if number > 0:  # keep the newest piece's checkpoints only
            old = self._piece_id(number - 1)
            coord.durable(f"removing {old}", lambda: coord.store.delete_prefix("ckpt", old, ""))
        return summary

    def _plan_of(self, piece_id: str) -> Plan | None:
        """The plan the last piece ended on, for the next one, if all its devices are here."""
        plan = read_plan(self.coord.store, piece_id)
        if plan is None:
            return None
        alive = self.coord.alive()
        return plan if all(d in alive for d in plan.devices) else None
