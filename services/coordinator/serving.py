"""A serving job from `ServeModel` to its cancel: the shell around `serve_core`.

Galaxy's workflow (§III-A) on our services: every device times the
Transformer blocks at a few partition sizes (its profiler phase), the planner
of the job's mode splits heads, MLP columns and sequence rows under each
device's memory budget (Algorithm 1 for `galaxy`), every device loads its
shard, and then requests are run one at a time, in arrival order, on all
devices at once; the rest wait in a bounded queue. Each answer records its
latency in the job's `metrics` stream. A device lost meanwhile is planned
around (`serve_recover`: the survivors load new shards under a new epoch and
the request in flight runs again), and one that comes back is taken in at the
next idle moment. The job ends when cancelled (its normal end), when a step
fails, or when the survivors of a loss cannot hold the model; training jobs
queued meanwhile wait for it.

Every decision is `serve_core.apply`'s; `ServeRun` feeds it what the
coordinator's socket brings (`Host.events`), the queue of requests and a
cancel, and carries its commands out: sends, Redis writes, the queue.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from pydantic import ValidationError

from common.errors import AsteroidError
from common.lifecycle import TERMINAL, JobState, advance
from common.logging import bind_global, get_logger
from common.secrets import mask_text
from common.serving_messages import InferReply, ServeSpec, TransformerShape
from services.coordinator import serve_core
from services.coordinator.core import Heard, Log, SendProbe, Tick
from services.coordinator.host import Host
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned
from services.coordinator.outcomes import JobCancelled
from services.coordinator.serve_state import (
    JOIN_TIMEOUT_S,
    LOAD_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    Answer,
    AppendMetrics,
    Broke,
    Command,
    Drop,
    Event,
    Limits,
    ReadShape,
    Serve,
    ShapeRead,
    Taken,
    TakeRequest,
    Waiting,
    profile_sizes,
    refusal,
)
from services.lib.galaxy.sources import from_checkpoint

__all__ = [
    "JOIN_TIMEOUT_S",
    "LOAD_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "PendingRequest",
    "ServeRun",
    "profile_sizes",
    "refusal",
]

log = get_logger(__name__)


class ServeRun:
    """One serving job on the coordinator's socket, steppable from one loop.

    `begin()` starts it, `feed(event)` hands it each event of `Host.events`
    (at a `Tick` it also looks for a cancel and at the queue of requests), and
    `ended` says when it is over; the coordinator's one loop does that.
    """

    def __init__(self, coord: Host, spec: ServeSpec) -> None:
        self.coord = coord
        self.spec = spec
        self.state: JobState = "submitted"
        self.epoch = int(time.time() * 1000) % (2**31)
        """Tells this job's replies and tiles from any earlier job's."""
        self.core: Serve | None = None
        self._released = True

    @property
    def ended(self) -> bool:
        """The job was cancelled or failed (and its end recorded)."""
        return self.core is not None and self.core.ended

    @property
    def requests(self) -> int:
        """Requests run on the devices so far."""
        return 0 if self.core is None else self.core.requests

    def begin(self) -> None:
        """Take the coordinator's job slot and start the core."""
        coord, jid = self.coord, self.spec.serve_id
        coord.running = jid
        coord.collecting = True  # probe answers come as events, in order with the replies
        self._released = False
        bind_global(job=jid)
        s = coord.settings
        limits = Limits(
            heartbeat_deadline_s=s.heartbeat_s * s.heartbeat_misses,
            probe_timeout_s=s.probe_timeout_s,
        )
        self.core, commands = serve_core.start(
            self.spec, limits, self.epoch, coord.members, sorted(coord.alive()), time.monotonic()
        )
        self._carry_out(commands)

    def stop(self, reason: str) -> None:
        """End the job at once (the coordinator stops): recorded cancelled, the queue refused.

        A cancel waits for the request under way to be answered; a stop does not.
        """
        if self.core is None or self._released:
            return
        self._step(Cancelled(reason))
        if not self.ended:  # a request runs: its answer is not waited for
            self._record("cancelled", reason=reason)
            self._release()

    def feed(self, event: Event) -> None:
        """Hand the core one event; at a `Tick`, a cancel and the queue go first."""
        if self.core is None or self.ended:
            return
        if isinstance(event, Tick):
            reason = self.coord.cancelled.pop(self.spec.serve_id, None)
            if reason is not None:
                self._step(Cancelled(reason))
            self._step(Waiting(tuple(self.coord.infer_queue)))
        self._step(event)

    def _step(self, event: Event) -> None:
        if self.core is None or self.ended:
            return
        self.core, commands = serve_core.apply(self.core, event, time.monotonic())
        self._carry_out(commands)

    def _carry_out(self, commands: list[Command]) -> None:
        """Do what the core asked, in order; feed back what a command answers.

        A command that fails (Redis gone for longer than an outage may last, a
        checkpoint that cannot be read) fails the job, and what was to follow it
        is dropped: the core decides again from the failure. A cancel that
        arrives while a write waits out an outage is fed as a cancel.
        """
        todo = deque(commands)
        while todo and self.core is not None:
            cmd = todo.popleft()
            try:
                answer = self._do(cmd)
            except JobCancelled as exc:
                if self.ended:
                    raise
                todo.clear()
                answer = Cancelled(str(exc))
            except (AsteroidError, ValidationError) as exc:
                if self.ended:
                    raise
                todo.clear()
                answer = Broke(mask_text(str(exc)))
            if answer is not None:
                self.core, more = serve_core.apply(self.core, answer, time.monotonic())
                todo.extend(more)
        if self.ended and not self._released:
            self._finish()

    def _do(self, cmd: Command) -> Event | None:
        """Carry out one command; the event it answers with, if any."""
        coord, jid = self.coord, self.spec.serve_id
        if isinstance(cmd, Send):
            coord.send(cmd.device, cmd.msg)
        elif isinstance(cmd, Answer):
            reply = cmd.reply
            if isinstance(reply, InferReply) and reply.error:
                reply = reply.model_copy(update={"error": mask_text(reply.error)})
            coord.send(cmd.peer, reply)
        elif isinstance(cmd, SendProbe | Heard | Log):
            coord.carry_out(cmd)
        elif isinstance(cmd, Record):
            self._record(cmd.state, **cmd.fields)
        elif isinstance(cmd, SetAssigned):
            coord.assigned = cmd.devices
        elif isinstance(cmd, AppendMetrics):
            entry = dict(cmd.entry)
            coord.write_soon(cmd.what, lambda: coord.store.append("metrics", jid, entry))
        elif isinstance(cmd, Drop):
            gone = cmd.requests
            coord.infer_queue.drop(lambda r: any(r is g for g in gone))
        elif isinstance(cmd, TakeRequest):
            return Taken(coord.infer_queue.take())
        elif isinstance(cmd, ReadShape):
            return self._read_shape(cmd)
        return None

    def _read_shape(self, cmd: ReadShape) -> ShapeRead:
        """The served shape and round of a training job's checkpoint."""
        config, _, chosen = self.coord.durable(
            f"reading the checkpoint of {cmd.job}",
            lambda: from_checkpoint(self.coord.store, cmd.job, cmd.round),
        )
        return ShapeRead(TransformerShape.of(config), chosen)

    def _record(self, to: JobState, **extra: Any) -> None:
        """Move to state `to` and write it to Redis.

        A step of a live job waits for Redis (`durable`); an end state is
        written as soon as Redis answers (`write_soon`), so an outage that ends
        the job neither hides why nor leaves it `running`.
        """
        self.state = advance(self.state, to)
        extra = {k: mask_text(v) if isinstance(v, str) else v for k, v in extra.items()}
        if to == "failed":
            log.error("serving job failed", error=extra.get("error"))
        jid = self.spec.serve_id

        def write() -> None:
            self.coord.write_state(jid, to, **extra)

        if to in TERMINAL:
            self.coord.write_soon(f"serving job {jid} {to}", write)
        else:
            self.coord.durable(f"serving job {jid} {to}", write)

    def _finish(self) -> None:
        """The job ended: refuse what still waits in the queue, then give up the slot."""
        self._step_ended(Waiting(tuple(self.coord.infer_queue)))
        self._release()

    def _step_ended(self, event: Waiting) -> None:
        if self.core is None:
            return
        self.core, commands = serve_core.apply(self.core, event, time.monotonic())
        for cmd in commands:
            self._do(cmd)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        coord = self.coord
        coord.running = None
        coord.assigned = frozenset()
        coord.collecting = False
        bind_global(job=None)
