"""One job from submission to its end: the shell around the job's pure core.

Profiling and planning come first (`_plan`); from the assignment on, every
decision is `driver.apply`'s, and `JobRun` only carries its commands out and
feeds it events: it owns the coordinator's ROUTER (through `Host.events`
and `send`), Redis (every write waits out an outage, `Host.durable`)
and the clock. It records every lifecycle transition in Redis (`job:<id>`
hash and the `events` stream) and every committed round in the `metrics` and
`ledger` streams. Rounds are committed only when every device reported; a
cancel takes effect at the next round boundary, so no half-applied round
survives it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from functools import partial
from typing import Any

import redis
from torch import Tensor

from common.checkpoint import (
    commit_checkpoint,
    latest_round,
    prune_checkpoints,
    remove_orphans,
    save_stage,
)
from common.errors import AsteroidError, ConfigError, StoreUnavailable
from common.ids import DeviceId
from common.init_weights import load_init
from common.lifecycle import TERMINAL, JobState, advance
from common.logging import bind_global, get_logger
from common.messages import PlanRequest
from common.plan import Plan, validate_async
from common.profile import ClusterSpec, load_profiles
from common.records.counters import raise_plan_epoch
from common.records.documents import put_cluster, put_plan, read_cluster, read_plan
from common.records.jobs import commit_round
from common.secrets import mask_text
from common.store import OUTAGE
from common.zoo import build_model
from services.coordinator import driver
from services.coordinator.checks import CheckedJob
from services.coordinator.core import Beats, Heard, Log, SendProbe
from services.coordinator.driver import (
    Append,
    Capacities,
    CheckpointFound,
    CheckStore,
    Command,
    CommitCheckpoint,
    EpochRaised,
    Event,
    PlanAgain,
    PlanFailed,
    PlanReady,
    Publish,
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
from services.coordinator.host import Host
from services.coordinator.link_survey import measure_links
from services.coordinator.membership import Members
from services.coordinator.metrics_stream import MetricsStream
from services.coordinator.outcomes import DeviceLost, JobCancelled, JobFailed, JobSummary
from services.coordinator.profiling import cluster_for, profile_budgets, profile_workers
from services.coordinator.recovery import (
    MemoryInputs,
    RecoveryImpossible,
    capacities,
    memory_inputs,
)
from services.coordinator.vetting import Vetting

__all__ = ["DeviceLost", "JobCancelled", "JobFailed", "JobRun", "JobSummary"]

log = get_logger(__name__)
LEDGER_MAX = 1_000_000
"""Entries the sample ledger keeps (one per committed round and recovery)."""
STREAM_MAX = 10_000
"""Entries the events stream keeps (the store's default cap)."""


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
        self.cluster: ClusterSpec | None = None
        """The cluster the job was last planned for (none yet, or resumed: read from Redis)."""
        self.vetting = Vetting(coord, coord.settings.probe_timeout_s)
        """Which devices a plan may name (claims as their fingerprint says, challenge answered)."""
        root = coord.settings.metrics_dir
        self.stream: MetricsStream | None = None
        """Files the committed metrics are copied to as they are recorded (`metrics_dir`)."""
        if root is not None:
            self.stream = MetricsStream(
                root, self.jid, partial(self.store.read, "metrics", self.jid)
            )

    # --- lifecycle -------------------------------------------------------------

    def record(self, to: JobState, **extra: Any) -> None:
        """Move to state `to` and write it to Redis (hash and events stream).

        A step of a live job waits for Redis (`durable`); an end state is written
        as soon as Redis answers (`write_soon`), so an outage that ends the job
        neither hides why nor leaves it `running`.
        """
        self.state = advance(self.state, to)
        log.info("job state", state=to, **extra)
        write = partial(self.coord.write_state, self.jid, to, **extra)
        if to in TERMINAL:
            self.coord.write_soon(f"job {self.jid} {to}", write)
        else:
            self.coord.durable(f"recording job state {to}", write)

    def run(self, plan: Plan | None = None, resume: bool = False, committed: int = 0) -> JobSummary:
        """Run the job to its end; with `plan`, skip profiling and planning.

        With `resume` and `committed` rounds recorded by an earlier coordinator,
        its stored plan is used and devices are asked to keep the state of that
        round (`_train`).

        Raises:
            JobFailed, JobCancelled, ConfigError: after recording the end state.

        """
        bind_global(job=self.jid)
        self.coord.running = self.jid
        try:
            if plan is None and resume and committed:
                plan = self._stored_plan()
            if plan is None:
                plan = self._plan()
            return self._train(plan, resume, committed)
        except JobCancelled as exc:
            self.record("cancelled", reason=str(exc))
            raise
        except AsteroidError as exc:
            self._drop_uploads()
            self.record("failed", error=str(exc))
            raise
        except OUTAGE as exc:  # a Redis step outside `durable` (profiling's cache, say)
            error = f"Redis at {self.store.where} is unreachable: {mask_text(str(exc))}"
            self.record("failed", error=error)
            raise StoreUnavailable(error) from exc
        except KeyboardInterrupt:
            self.record("cancelled", reason="the coordinator was stopped")
            raise
        finally:
            self.coord.running = None
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

    def _plan(self) -> Plan:
        """Profile the workers' devices (cached profiles reused), then ask the planner."""
        coord = self.coord
        members = self.vetting.wait(self.job.min_workers, coord.settings.join_timeout_s)
        self.record("profiling", workers=sorted(members))
        return self._planned(members, "planning")[0]

    def _planned(
        self,
        members: Members,
        state: JobState | None,
        current: Plan | None = None,
        slowdowns: Mapping[DeviceId, float] | None = None,
    ) -> tuple[Plan, float]:
        """The planner's plan for `members` (profiled first; cached profiles reused).

        The links are measured first unless the cluster spec gives them; each
        device's profiled times are multiplied by its measured `slowdowns`; with
        `current`, also the planner's prediction of it on the same cluster (0: none).
        """
        job, coord = self.job, self.coord
        if job.global_batch is None:
            raise ConfigError("global_batch: required when the planner makes the plan")
        settings = coord.settings
        members = self.vetting.vetted(members)
        keys = profile_workers(coord, job, members)
        base = coord.cluster_base()
        budgets = profile_budgets(coord, keys)
        measured = None if base is not None and base.links else measure_links(coord, members)
        cluster = cluster_for(
            members, keys, budgets, base, settings.link_bandwidth, measured, slowdowns
        )
        put_cluster(self.store, self.jid, cluster)
        self.cluster = cluster
        if state is not None:
            self.record(state, planner=job.planner)
        req = PlanRequest(
            job_id=self.jid,
            planner=job.planner,
            cluster=cluster,
            profiles=sorted(set(keys.values())),
            global_batch=job.global_batch,
            microbatches=job.microbatches or 1,
            current=current,
            mode=job.mode,
            aggregate_every=job.aggregate_every,
        )
        return coord.request_scored_plan(req, settings.plan_timeout_s)

    # --- training: the core's shell -------------------------------------------

    def _stored_plan(self) -> Plan | None:
        """The plan the job last ran on, if Redis has one."""
        return self.coord.durable("reading the plan", lambda: read_plan(self.store, self.jid))

    def _train(self, plan: Plan, resume: bool, committed: int = 0) -> JobSummary:
        """Prepare the first assignment, then let the core run the job to its end.

        Resumed after `committed` rounds newer than the newest checkpoint, the
        devices keep the state they hold of that round (they outlive a
        coordinator); any that cannot sends the job back to the checkpoint.
        """
        job, jid, coord = self.job, self.jid, self.coord
        layers = self.checked.layers
        plan.validate_for(layers)
        if job.mode == "async":
            validate_async(plan)
        store = self.store
        coord.durable("storing the plan", lambda: put_plan(store, jid, plan))
        coord.wait_for_devices(plan.devices, coord.settings.join_timeout_s)
        start = (
            coord.durable("finding the checkpoint", lambda: latest_round(store, jid))
            if resume
            else None
        )
        from_peers = start is not None and committed > start
        if from_peers:
            start = committed
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
        )
        costs, _, memory = coord.durable("reading the job's profiles", self._capacities)
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
        run, more = driver.apply(run, Beats(coord.members), time.monotonic())
        run = self._carry_out(run, [*commands, *more])
        run = self._drive(run)
        if run.phase == "cancelled":
            raise JobCancelled(run.outcome)
        if run.phase == "failed":
            raise JobFailed(run.outcome)
        return JobSummary.of(jid, self.total, run.summary)

    def _drive(self, run: Run) -> Run:
        """Feed the core what the network brings until the job ends."""
        coord = self.coord
        coord.collecting = True
        try:
            while not run.ended:
                for event in coord.events():
                    run = self._feed(run, event)
                    if run.ended:
                        break
                reason = coord.cancelled.pop(self.jid, None)
                if reason is not None:
                    run = self._feed(run, driver.Cancelled(reason))
                while coord.drains:
                    device, why = coord.drains.popitem()
                    run = self._feed(run, driver.Drain(device, why))
        finally:
            coord.collecting = False
        return run

    def _feed(self, run: Run, event: Event) -> Run:
        run, commands = driver.apply(run, event, time.monotonic())
        run = self._carry_out(run, commands)
        bind_global(round=run.step, phase=run.phase)  # log lines name where the job is
        return run

    def _carry_out(self, run: Run, commands: list[Command]) -> Run:
        """Do what the core asked, in order; feed back what a command answers.

        A command that answers (RaiseEpoch, ReadCapacities, ReadCheckpoint,
        RequestPlan, PlanAgain) is always the last of its list, so its answer's commands
        simply follow.
        """
        todo = deque(commands)
        while todo:
            answer = self._do(todo.popleft())
            if answer is not None:
                run, more = driver.apply(run, answer, time.monotonic())
                todo.extend(more)
        return run

    def _do(self, cmd: Command) -> Event | None:
        """Carry out one command; the event it answers with, if any."""
        coord, store, jid = self.coord, self.store, self.jid
        if isinstance(cmd, Send):
            coord.send(cmd.device, cmd.msg)
        elif isinstance(cmd, SendProbe | Heard | Log):
            coord.carry_out(cmd)
        elif isinstance(cmd, Record):
            self.record(cmd.state, **cmd.fields)
        elif isinstance(cmd, Publish):
            self._publish(cmd)
        elif isinstance(cmd, Append):
            maxlen = LEDGER_MAX if cmd.stream == "ledger" else STREAM_MAX
            entry = dict(cmd.entry)
            coord.durable(cmd.what, lambda: store.append(cmd.stream, jid, entry, maxlen=maxlen))
        elif isinstance(cmd, StorePlan):
            coord.durable("storing the plan", lambda: put_plan(store, jid, cmd.plan))
        elif isinstance(cmd, SetAssigned):
            coord.assigned = cmd.devices
        elif isinstance(cmd, CheckStore):
            # leaders write to Redis; they wait out an outage themselves, but none need start in one
            coord.durable(cmd.what, store.probe)
        elif isinstance(cmd, CommitCheckpoint):
            self._commit(cmd)
        else:
            return self._ask(cmd)
        return None

    def _ask(
        self, cmd: RaiseEpoch | ReadCapacities | ReadCheckpoint | RequestPlan | PlanAgain
    ) -> Event:
        """Carry out a command whose answer the core waits for."""
        coord, store, jid = self.coord, self.store, self.jid
        if isinstance(cmd, RaiseEpoch):
            return EpochRaised(
                coord.durable("raising the plan epoch", lambda: raise_plan_epoch(store))
            )
        if isinstance(cmd, ReadCapacities):
            return Capacities(*coord.durable("reading the job's profiles", self._capacities))
        if isinstance(cmd, ReadCheckpoint):
            return CheckpointFound(
                coord.durable("finding the checkpoint", lambda: latest_round(store, jid))
            )
        # RequestPlan, or PlanAgain: `_planned` measures the links again either way
        members = {d: m for d, m in coord.alive().items() if d in cmd.devices}
        current = cmd.current if isinstance(cmd, PlanAgain) else None
        slowdowns = cmd.slowdowns if isinstance(cmd, PlanAgain) else {}
        try:
            plan, current_s = self._planned(members, None, current, slowdowns)
            if self.job.mode == "async":
                validate_async(plan)
        except (AsteroidError, RecoveryImpossible) as exc:
            return PlanFailed(str(exc))
        return PlanReady(plan, (current_s or None) if current is not None else None)

    def _commit(self, cmd: CommitCheckpoint) -> None:
        """Publish a checkpoint (every layer is written); a job's own one is an event too.

        Once it is durable, the oldest beyond the job's `keep_checkpoints` go.
        """
        store, jid = self.store, self.jid

        def commit() -> None:
            digests = None if cmd.digests is None else [dict(d) for d in cmd.digests]
            commit_checkpoint(store, jid, cmd.round, cmd.layers, digests, cmd.version)
            if cmd.digests is not None:
                store.append("events", jid, {"event": "checkpoint", "round": cmd.round})
            store.wait_durable()
            prune_checkpoints(store, jid, self.job.keep_checkpoints)  # once the new one is durable

        what = f"committing the checkpoint of round {cmd.round}"
        self.coord.durable(what, commit)

    def _capacities(
        self,
    ) -> tuple[list[float] | None, dict[DeviceId, float] | None, MemoryInputs | None]:
        """Layer costs, device speeds and memory inputs from the job's profiles; None if unknown.

        A device's budget is what its heartbeat reports, else what the planner was
        given for it, else 0 (unknown, so unlimited): the survivors' plan must fit
        the memory they really have, not just balance their speed.
        """
        cluster = self.cluster
        if cluster is None:  # resumed: the cluster an earlier coordinator planned for
            cluster = read_cluster(self.store, self.jid)
            if cluster is None:
                return None, None, None
        try:
            keys = sorted({d.profile for d in cluster.devices if d.profile})
            profiles = load_profiles(self.store, keys)
        except ConfigError:  # a profile is gone: weigh layers and devices alike
            return None, None, None
        planned = {DeviceId(device.name): device.memory_bytes for device in cluster.devices}
        budgets = {
            d: m.info.memory_budget or planned.get(d, 0) for d, m in self.coord.members.items()
        }
        memory = memory_inputs(cluster, profiles, budgets)
        if self.job.global_batch is None:
            return None, None, memory
        try:
            costs, speeds = capacities(cluster, profiles, self.job.global_batch)
        except RecoveryImpossible:
            return None, None, memory
        return costs, speeds, memory

    def _publish(self, cmd: Publish) -> None:
        """Update the job's hash and its metrics (and ledger) streams, waiting out an outage.

        The job goes on only once all are written: a round is committed when Redis
        says so, which is what makes an outage pause the job at a round boundary.
        The metrics entry gets the wall-clock `time` of that commit (TensorBoard
        places the point there); with `metrics_dir`, the entry is copied to the
        job's files next.
        """
        store, jid = self.store, self.jid
        metrics = dict(cmd.metrics)

        def write() -> None:
            metrics["time"] = now = time.time()
            entries = {"metrics": (metrics, STREAM_MAX)}
            if cmd.ledger is not None:
                entries["ledger"] = (dict(cmd.ledger), LEDGER_MAX)
            commit_round(store, jid, cmd.fields, entries, now)
            if cmd.ledger is not None:
                store.wait_durable()  # a round is committed once Redis has it on disk

        self.coord.durable(cmd.what, write)
        if self.stream is not None:
            self.stream.record(metrics)
