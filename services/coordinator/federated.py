"""A home of a federation: the coordinator's federated job type.

The job trains like any other, on this home's devices with its plan, but in pieces:
it joins the federation (`asteroid-federation`) with its sample count and label
histogram, then repeatedly fetches the model to start from, trains `rounds` local
rounds as a job of its own (``<job>.r<N>``: planned, checkpointed and recovered like
any job), and sends the resulting model with the time the piece took, its response
latency. The federation decides when the job ends. No sample ever leaves the home.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import zmq
from torch import Tensor

from common.checkpoint import load_full_state
from common.codec import Limits, recv_message, send_message
from common.curve import COORDINATOR, load_keys
from common.errors import AsteroidError, ConfigError, ProtocolError
from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.fl.data import label_histogram
from common.fl.wire import state_frame, state_from_frame
from common.job import FederatedSpec, check_job_id
from common.job_data import open_data
from common.logging import get_logger
from common.message_base import WireModel
from common.messages import Message
from common.plan import Plan
from common.records.documents import read_plan
from common.sockets import connect_dealer
from common.zoo import build_model
from services.coordinator.checks import CheckedJob
from services.coordinator.host import Host
from services.coordinator.jobs import JobCancelled, JobFailed, JobRun, JobSummary

__all__ = ["FederatedRun", "FederationLink", "home_identity"]

log = get_logger(__name__)
A = TypeVar("A", bound=WireModel)
RESEND_S = 5.0
"""How long a home waits for an answer before sending its request again."""


def home_identity(home: int) -> str:
    """A home's routing identity, and the name of its key in the federation's key set."""
    return f"home-{home}"


class FederationLink:
    """One home's DEALER to the federation: a request, then the reply of the kind awaited.

    While it waits, `idle` keeps the home's own coordinator serving its workers.
    """

    def __init__(self, spec: FederatedSpec, federation: str, idle: Callable[[float], None]) -> None:
        self.spec, self.federation, self.idle = spec, federation, idle
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

    def ask(
        self, msg: Message, answer: type[A], tensors: list[Tensor] | None = None
    ) -> tuple[A, list[Tensor]]:
        """Send `msg`; the federation's first reply of kind `answer`, with its frames.

        Sent again every `RESEND_S` without an answer: every request is safe to
        repeat (a repeated update is refused as stale and changes nothing). A
        refusal raises, except a stale one (its round had closed), which comes
        back to the caller as the FederationReply it is.

        Raises:
            JobFailed: No answer within the spec's timeout, or the federation refused.

        """
        while self.sock.poll(0, zmq.POLLIN):  # answers to resent requests: out of date
            self.sock.recv_multipart()
        send_message(self.sock, msg, self.name, tensors or [])
        now = time.monotonic()
        deadline, resend = now + self.spec.timeout_s, now + RESEND_S
        while time.monotonic() < deadline:
            if not self.sock.poll(0, zmq.POLLIN):
                self.idle(0.05)
                if time.monotonic() > resend:  # a restarted federation lost the request
                    send_message(self.sock, msg, self.name, tensors or [])
                    resend = time.monotonic() + RESEND_S
                continue
            try:
                _, env = recv_message(self.sock, self.limits)
            except ProtocolError as exc:
                log.warning("bad message from the federation", reason=exc.reason)
                continue
            got = env.msg
            if isinstance(got, FederationReply) and not got.ok and not got.stale:
                raise JobFailed(f"the federation refused the {msg.type}: {got.error}")
            if isinstance(got, answer):
                return got, env.tensors
        raise JobFailed(
            f"the federation at {self.spec.address} did not answer the {msg.type} within "
            f"{self.spec.timeout_s:g} s"
        )


class FederatedRun:
    """Runs a job with a `federation` section as one home of that federation."""

    def __init__(self, coord: Host, checked: CheckedJob) -> None:
        job = checked.spec
        if job.federation is None:
            raise ConfigError(f"job {job.job_id} has no federation section")
        self.coord, self.checked, self.job, self.spec = coord, checked, job, job.federation
        self.federation = job.federation.federation_id
        self.pieces = 0
        self.model = build_model(job.model, job.seed, coord.settings.model_modules)

    def run(self, plan: Plan | None = None) -> JobSummary:
        """Take part until the federation says it is done; the last piece's summary.

        Raises:
            JobFailed, JobCancelled, ConfigError: after recording the end state.

        """
        coord, jid = self.coord, self.job.job_id
        coord.write_state(jid, "running", federation=self.federation, home=self.spec.home)
        coord.federated = jid
        link = FederationLink(self.spec, self.federation, self._idle)
        try:
            summary = self._take_part(link, plan)
        except JobCancelled as exc:
            coord.cancelled.pop(jid, None)
            coord.write_state(jid, "cancelled", reason=str(exc))
            raise
        except AsteroidError as exc:
            coord.write_state(jid, "failed", error=str(exc))
            raise
        finally:
            coord.federated = None
            link.close()
        coord.write_state(jid, "finished", pieces=self.pieces)
        return summary

    def _idle(self, seconds: float) -> None:
        """Serve the home's workers while the federation is awaited; stop if cancelled."""
        self.coord.pump(seconds)
        self.coord.check_cancelled(self.job.job_id)

    def _take_part(self, link: FederationLink, plan: Plan | None) -> JobSummary:
        job, home = self.job, self.spec.home
        data = open_data(job, self.model)
        if data.train_size is None:
            raise ConfigError("a federated job needs a finite data set (digits, cifar10)")
        labels = data.train.labels(torch.arange(data.train_size, dtype=torch.int64))
        histogram = list(label_histogram(labels, self.model.num_classes))
        join = JoinFederation(
            federation=self.federation,
            home=home,
            model=job.model,
            num_samples=data.train_size,
            histogram=histogram,
        )
        link.ask(join, FederationReply)
        summary: JobSummary | None = None
        reference = self.model.full().state_dict()
        while True:
            self.coord.check_cancelled(job.job_id)
            asked = time.monotonic()  # the latency counts the model's download too
            task, frames = link.ask(
                FetchModel(federation=self.federation, home=home), FederatedModel
            )
            if task.status == "done":
                break
            if task.status == "wait":
                self._idle(max(task.wait_s, 0.05))
                continue
            start = state_from_frame(frames, reference, "the federation")
            summary, state = self._piece(start, plan)
            latency = time.monotonic() - asked
            plan = self._plan_of(summary.job_id)
            update = HomeUpdate(
                federation=self.federation,
                home=home,
                round_id=task.round_id,
                num_samples=data.train_size,
                latency_s=latency,
                local_accuracy=summary.evals[-1][2] if summary.evals else -1.0,
            )
            reply, _ = link.ask(update, FederationReply, [state_frame(state)])
            if not reply.ok:  # stale: its round had closed; the next fetch says what now
                log.warning("update came after its round closed", error=reply.error)
            log.info(
                "home update sent",
                piece=self.pieces,
                round_id=task.round_id,
                status=task.status,
                latency_s=round(latency, 3),
                version=reply.version,
            )
        if summary is None:
            raise JobFailed(f"the federation {self.federation} ended before this home trained")
        return summary

    def _piece(
        self, start: Mapping[str, Tensor], plan: Plan | None
    ) -> tuple[JobSummary, dict[str, Tensor]]:
        """Train `rounds` local rounds from `start` as job ``<job>.r<N>``; its final model."""
        coord, job = self.coord, self.job
        piece_id = check_job_id(f"{job.job_id}.r{self.pieces}", f"federated job {job.job_id}")
        self.pieces += 1
        piece = job.model_copy(
            update={"job_id": piece_id, "federation": None, "seed": job.seed + self.pieces}
        )
        checked = self.checked.piece(piece)
        total = checked.rounds
        coord.durable(f"registering {piece_id}", lambda: coord.register(checked, forget_old=True))
        summary = JobRun(coord, checked, initial=start).run(plan)
        state = coord.durable(
            f"reading the model of {piece_id}",
            lambda: load_full_state(coord.store, piece_id, total),
        )
        if self.pieces > 1:  # keep the newest piece's checkpoints only
            old = f"{job.job_id}.r{self.pieces - 2}"
            coord.durable(f"removing {old}", lambda: coord.store.delete_prefix("ckpt", old, ""))
        return summary, state

    def _plan_of(self, piece_id: str) -> Plan | None:
        """The plan the last piece ended on, for the next one, if all its devices are here."""
        plan = read_plan(self.coord.store, piece_id)
        if plan is None:
            return None
        alive = self.coord.alive()
        return plan if all(d in alive for d in plan.devices) else None
