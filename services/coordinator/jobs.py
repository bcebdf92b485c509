"""One job from submission to its end: the shell around the job's pure cores.

Preparation (waiting for vetted workers, profiling, links, planning, the plan's
devices) is `prepare.apply`'s; from the assignment on, every decision is
`driver.apply`'s (a re-plan it asks for runs the preparation core again, from
the vetting of the devices it names). `JobRun` only feeds them events and
carries their commands out (`job_effects`): it owns the coordinator's ROUTER
(through `Host.events` and `send`), Redis and the clock. A training step's
Redis write never waits in place: an outage holds it and what follows it
(`held.Held`) and is an event the training core decides on (`outages`); a
preparation's waits it out (`Host.durable`). It records every lifecycle
transition in Redis (`job:<id>` hash and the `events` stream) and every
committed round in the `metrics` and `ledger` streams. Rounds are committed only when every device
reported; a cancel takes effect at the next round boundary, so no half-applied
round survives it.

A run is stepped by the coordinator's one loop (`service.Coordinator._loop`):
`begin()` sends the first commands, `feed(event)` takes one event, `ended`
says when it is over and `result()` gives its summary or raises what ended it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import redis
from torch import Tensor

from common.checkpoint import commit_checkpoint, latest_round, remove_orphans, save_stage
from common.errors import AsteroidError, ConfigError, StoreUnavailable
from common.ids import DeviceId
from common.init_weights import load_init
from common.lifecycle import TERMINAL, JobState, advance
from common.logging import bind_global, get_logger
from common.plan import Plan
from common.records.documents import read_plan
from common.secrets import mask_text
from common.store import OUTAGE
from common.zoo import build_model
from services.coordinator import driver, outages, prepare
from services.coordinator.checks import CheckedJob
from services.coordinator.core import Beats, Heard, Log, ProbeAnswer, Reply, SendProbe, Tick
from services.coordinator.driver import (
    Cancelled,
    Command,
    Drain,
    Event,
    PlanAgain,
    PlanFailed,
    PlanReady,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    RequestPlan,
    Run,
    Send,
    SetAssigned,
    StorePlan,
)
from services.coordinator.held import Held
from services.coordinator.host import Host
from services.coordinator.job_effects import Effects, prep_limits
from services.coordinator.metrics_stream import MetricsStream
from services.coordinator.outcomes import DeviceLost, JobCancelled, JobFailed, JobSummary
from services.coordinator.prepare_state import Command as PrepCommand
from services.coordinator.prepare_state import Prep, Services

__all__ = ["DeviceLost", "JobCancelled", "JobFailed", "JobRun", "JobSummary"]

log = get_logger(__name__)
_challenges = {"next": -1}
"""The next challenge nonce of this process: challenges count down, never reused."""


class JobRun:
    """Drives one job through its lifecycle on a coordinator's workers."""

    def __init__(
        self,
        coord: Host,
        checked: CheckedJob,
        initial: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Ready a run of the `checked` job.

        `initial`: the whole model's weights to start from instead of the seed's
        (a federated home's local rounds start from the federation's model).
        """
        self.coord, self.checked = coord, checked
        self.job, self.jid = checked.spec, checked.job_id
        self.initial = initial
        self.total = checked.rounds
        self.state: JobState = "submitted"
        self.store = coord.store
        root = coord.settings.metrics_dir
        self.stream: MetricsStream | None = None
        """Files the committed metrics are copied to as they are recorded (`metrics_dir`)."""
        if root is not None:
            self.stream = MetricsStream(
                root, self.jid, partial(self.store.read, "metrics", self.jid)
            )
        self.effects = Effects(coord, self.job, self.recorded, self.stream)
        self.held: Held[Command] = Held(self._do, self._told, _passes)
        """The training core's commands, held behind a Redis step an outage refused."""
        self.prep: Prep | None = None
        """The preparation under way: the job's start, or a re-plan the training core asked for."""
        self.train: Run | None = None
        """The training core's state, from the first assignment on."""
        self.proven: frozenset[DeviceId] = frozenset()
        """Devices that answered a challenge: not asked again for this job."""
        self.refused: Mapping[DeviceId, str] = {}
        """Devices left out of plans so far, and why (each logged once)."""
        self.resume, self.committed = False, 0
        self.summary: JobSummary | None = None
        self.error: BaseException | None = None
        self._open = False

    # --- lifecycle -------------------------------------------------------------

    def record(self, to: JobState, **extra: Any) -> None:
        """Move to state `to` and write it to Redis (hash and events stream), waiting for Redis."""
        self.recorded(to, extra, False)

    def recorded(self, to: JobState, fields: Mapping[str, Any], tried_once: bool) -> None:
        """Move to state `to` and write it to Redis (hash and events stream).

        A step of a live job needs Redis: a preparation's waits an outage out
        (`durable`), the training core's is `tried_once` (an outage raises, the
        run holds it, and the state moves once it is written). An end state is
        written as soon as Redis answers (`write_soon`), so an outage that ends
        the job neither hides why nor leaves it `running`.
        """
        state = advance(self.state, to)
        write = partial(self.coord.write_state, self.jid, to, **fields)
        what = f"recording job state {to}"
        if to in TERMINAL:
            self.coord.write_soon(f"job {self.jid} {to}", write)
        elif tried_once:
            self.effects.once(what, write)
        else:
            self.coord.durable(what, write)
        self.state = state
        log.info("job state", state=to, **fields)

    @property
    def ended(self) -> bool:
        """The job finished, failed or was cancelled (`result` says which)."""
        return self.summary is not None or self.error is not None

    def result(self) -> JobSummary:
        """The finished job's summary.

        Raises:
            JobFailed, JobCancelled, ConfigError, StoreUnavailable: what ended the job.

        """
        if self.error is not None:
            raise self.error
        if self.summary is None:
            raise RuntimeError(f"job {self.jid} has not ended")
        return self.summary

    def begin(self, plan: Plan | None = None, resume: bool = False, committed: int = 0) -> None:
        """Start the job: its preparation's first commands (with `plan`: the wait for devices)."""
        bind_global(job=self.jid)
        self.coord.running = self.jid
        self.coord.collecting = True  # challenge and probe answers come as events
        self._open = True
        self.resume, self.committed = resume, committed
        self._guarded(self._begin, plan)

    def feed(self, event: Event | Services) -> None:
        """Take one event: what the network brought, time passing, a cancel or a drain.

        After a `Tick` the host's pending cancel, drains and known services are fed too.
        """
        if not self.ended:
            self._guarded(self._feed, event)

    def stop(self, reason: str) -> None:
        """End the job cancelled at once (the coordinator is stopping)."""
        if not self.ended:
            self.record("cancelled", reason=reason)
            self._end(error=JobCancelled(reason))

    def _guarded(self, step: Any, *args: Any) -> None:
        """Run a step; an error that ends the job is recorded, and kept for `result`."""
        try:
            step(*args)
        except JobCancelled as exc:
            self.record("cancelled", reason=str(exc))
            self._end(error=exc)
        except AsteroidError as exc:
            self._drop_uploads()
            self.record("failed", error=str(exc))
            self._end(error=exc)
        except OUTAGE as exc:  # a Redis step outside `durable`
            error = f"Redis at {self.store.where} is unreachable: {mask_text(str(exc))}"
            self.record("failed", error=error)
            self._end(error=StoreUnavailable(error))

    def _end(self, summary: JobSummary | None = None, error: BaseException | None = None) -> None:
        self.summary, self.error = summary, error
        if self._open:
            self._open = False
            self.coord.running = None
            self.coord.collecting = False
            if self.stream is not None:
                self.stream.close()

    def _drop_uploads(self) -> None:
        """Delete what uploads of uncommitted checkpoints left, before recording a failure.

        A write Redis refused for want of memory leaves its first chunks behind;
        deleting them (a full Redis still takes DEL) makes room for the failed
        state. Committed checkpoints stay. Best effort: the failure is recorded
        either way (or once Redis takes writes again, `write_soon`).
        """
        try:
            removed = remove_orphans(self.store, self.jid, newer_too=True)
        except redis.RedisError as exc:
            log.warning(
                "could not remove uncommitted checkpoint uploads", error=mask_text(str(exc))
            )
            return
        if removed:
            log.info("removed uncommitted checkpoint uploads of the failed job", keys=removed)

    # --- events ------------------------------------------------------------------

    def _begin(self, plan: Plan | None) -> None:
        coord, now = self.coord, time.monotonic()
        if plan is None and self.resume and self.committed:
            plan = coord.durable("reading the plan", lambda: read_plan(self.store, self.jid))
        layers = self.checked.layers
        if plan is None:
            prep, cmds = prepare.start(
                self.job,
                layers,
                prep_limits(self.coord),
                now,
                coord.members,
                coord.services,
                _challenges["next"],
            )
        else:
            prep, cmds = prepare.with_plan(
                self.job, layers, prep_limits(self.coord), plan, now, coord.members
            )
        self._prepared(prep, cmds)

    def _feed(self, event: Event | Services) -> None:
        if isinstance(event, Tick):  # Redis may be back: before the core judges the outage
            self.held.tick()
            self._settle()
        self._one(event)
        if not isinstance(event, Tick):
            return
        coord = self.coord
        if self.prep is not None:
            self._one(Services(dict(coord.services)))
        reason = coord.cancelled.pop(self.jid, None)
        if reason is not None:
            self._one(Cancelled(reason))
        while self.train is not None and coord.drains and not self.ended:
            device, why = coord.drains.popitem()
            self._one(Drain(device, why))

    def _one(self, event: Event | Services) -> None:
        """Feed one event to the training core and to the preparation under way."""
        if self.ended:
            return
        challenge = isinstance(event, ProbeAnswer) and event.nonce < 0
        if self.train is not None and not challenge and not isinstance(event, Services):
            self._trained(event)
        if self.prep is not None and not self.ended and isinstance(event, _PREP_EVENTS):
            prep, cmds = prepare.apply(self.prep, event, time.monotonic())
            self._prepared(prep, cmds)

    # --- preparation -----------------------------------------------------------------

    def _prepared(self, prep: Prep, commands: list[PrepCommand]) -> None:
        """Carry out the preparation's commands, feeding back their answers; act on its end."""
        prep = self.effects.prepared(prep, commands)
        self.prep = prep
        self.proven, self.refused = prep.proven, prep.refused
        _challenges["next"] = min(_challenges["next"], prep.next_challenge)
        if prep.ended:
            self.prep = None
            self._ended_prep(prep)

    def _ended_prep(self, prep: Prep) -> None:
        if prep.replan:  # the training core waits for its answer
            if prep.phase == "ready" and prep.plan is not None:
                current_s = (prep.current_s or None) if prep.current is not None else None
                self._trained(PlanReady(prep.plan, current_s))
            else:
                self._trained(PlanFailed(prep.outcome))
        elif prep.phase == "cancelled":
            raise JobCancelled(prep.outcome)
        elif prep.phase == "failed":
            raise ConfigError(prep.outcome) if prep.config else JobFailed(prep.outcome)
        else:
            assert prep.plan is not None  # ready
            self._train(prep.plan)

    def _replan(self, cmd: RequestPlan | PlanAgain) -> None:
        """The training core asks for the planner's plan: prepare again, on `cmd.devices`."""
        coord = self.coord
        devices = {d: m for d, m in coord.alive().items() if d in cmd.devices}
        prep, cmds = prepare.replan(
            self.job,
            self.checked.layers,
            prep_limits(self.coord),
            devices,
            time.monotonic(),
            coord.members,
            coord.services,
            self.proven,
            self.refused,
            _challenges["next"],
            cmd.current if isinstance(cmd, PlanAgain) else None,
            cmd.slowdowns if isinstance(cmd, PlanAgain) else None,
        )
        self._prepared(prep, cmds)

    # --- training: the core's shell -------------------------------------------

    def _train(self, plan: Plan) -> None:
        """The plan's devices are heard from: prepare the first assignment, start the core.

        Resumed after `committed` rounds newer than the newest checkpoint, the
        devices keep the state they hold of that round (they outlive a
        coordinator); any that cannot sends the job back to the checkpoint.
        """
        job, jid, coord, store = self.job, self.jid, self.coord, self.store
        layers = self.checked.layers
        start = (
            coord.durable("finding the checkpoint", lambda: latest_round(store, jid))
            if self.resume
            else None
        )
        from_peers = start is not None and self.committed > start
        if from_peers:
            start = self.committed
        if start is None:  # a fresh start; a resumed job goes on from its checkpoint
            start = 0
            model = build_model(job.model, job.seed, coord.settings.model_modules).full()
            if self.initial is not None:
                model.load_state_dict(self.initial)
            elif job.init_from is not None:
                load_init(job.init_from, model)

            def initial() -> None:
                save_stage(store, jid, 0, model, None, 0)
                commit_checkpoint(store, jid, 0, layers)

            coord.durable("saving the initial weights", initial)
        s = coord.settings
        limits = driver.Limits(
            round_timeout_s=s.round_timeout_s,
            heartbeat_deadline_s=s.heartbeat_s * s.heartbeat_misses,
            probe_timeout_s=s.probe_timeout_s,
            hung_min_s=s.hung_min_s,
            hung_factor=s.hung_factor,
            redis_outage_s=s.redis_outage_s,
        )
        costs, _, memory = coord.durable("reading the job's profiles", self.effects.capacities)
        run, commands = driver.start(
            job,
            self.total,
            layers,
            self.checked.train_size,
            limits,
            plan,
            start,
            from_peers,
            costs,
            memory,
            self.checked.eval_size,
        )
        run = coord.timeouts.follow(None, run)  # the limits in force, not the settings
        run, more = driver.apply(run, Beats(coord.members), time.monotonic())
        self.train = run
        self._carry_out([*commands, *more])

    def _trained(self, event: Event) -> None:
        """Feed the training core one event; carry out what it says; end with it."""
        run = self.train
        assert run is not None  # training started
        run, commands = driver.apply(run, event, time.monotonic())
        self.train = self.coord.timeouts.follow(self.train, run)
        self._carry_out(commands)

    def _carry_out(self, commands: list[Command]) -> None:
        """Do what the core asked, in order, or hold it behind a Redis outage; act on its end."""
        self.held.carry_out(commands)
        self._settle()

    def _do(self, cmd: Command) -> Sequence[Command]:
        """Carry out one command; the core's commands that answer it (they follow it at once).

        A command that answers (RaiseEpoch, ReadCapacities, ReadCheckpoint) is
        always the last of its list, so its answer's commands simply follow; a
        re-plan (RequestPlan, PlanAgain) is answered once its preparation ends.
        A Redis step raises `held.Away` when Redis is away (`held.Held` holds it).
        """
        if isinstance(cmd, RequestPlan | PlanAgain):
            self._replan(cmd)
        elif isinstance(cmd, RaiseEpoch | ReadCapacities | ReadCheckpoint):
            return self._told(self.effects.ask(cmd))
        elif isinstance(cmd, Send | SendProbe | Heard | Log | Record | StorePlan | SetAssigned):
            self.effects.shared(cmd, tried_once=True)
        else:
            self.effects.train(cmd)
        return []

    def _told(self, event: Event) -> Sequence[Command]:
        """Feed the training core an answer or Redis's coming and going; its commands."""
        run = self.train
        assert run is not None  # training started
        run, commands = driver.apply(run, event, time.monotonic())
        self.train = run
        return commands

    def _settle(self) -> None:
        """End with the training core: failed or cancelled at once, finished once all is done.

        A finished job's last commit may still be held behind a Redis outage.
        """
        run = self.train
        if run is None:
            return
        bind_global(round=run.step, phase=run.phase)  # log lines name where the job is
        if not run.ended or self.ended:
            return
        if run.phase == "cancelled":
            raise JobCancelled(run.outcome)
        if run.phase == "failed":
            raise StoreUnavailable(run.outcome) if outages.gave_up(run) else JobFailed(run.outcome)
        if self.held.idle:
            self._end(summary=JobSummary.of(self.jid, self.total, run.summary))


def _passes(cmd: Command) -> bool:
    """Commands that commit nothing (probe, count an answer, log): never held behind Redis."""
    return isinstance(cmd, SendProbe | Heard | Log)


_PREP_EVENTS = (Beats, Reply, ProbeAnswer, Tick, Cancelled, Services)
"""What a preparation takes of the events (no drain, no answer meant for the training core)."""
