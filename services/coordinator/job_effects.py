"""What a job's cores ask of the world, carried out: Redis through an outage, the socket, logs.

`jobs.JobRun` feeds events to the preparation core (`prepare`) and then to the
training core (`driver`); both answer with commands, and this module carries
out those that touch Redis, the ROUTER or the log. A command that reads
something returns the event that answers it (the core waits for it); the rest
return None. A preparation's Redis steps wait out an outage (`Host.durable`);
the training core's are tried once (`held.once`): an outage raises, and the
run holds the step and what follows it (`held.Held`) while the core decides.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

from pydantic import ValidationError

from common.checkpoint import commit_checkpoint, latest_round, prune_checkpoints
from common.errors import AsteroidError, ConfigError
from common.ids import DeviceId
from common.job import JobSpec
from common.lifecycle import JobState
from common.logging import get_logger
from common.profile import ClusterSpec, Profile, load_profiles
from common.records.counters import raise_plan_epoch
from common.records.documents import put_cluster, put_plan, read_cluster
from common.records.jobs import Waiting, commit_round, write_job
from services.coordinator import links, prepare
from services.coordinator.core import Heard, Log, SendProbe
from services.coordinator.driver import (
    Append,
    Capacities,
    CheckpointFound,
    CheckStore,
    CommitCheckpoint,
    EpochRaised,
    Publish,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    Send,
    SetAssigned,
    StorePlan,
)
from services.coordinator.held import once
from services.coordinator.host import Host
from services.coordinator.metrics_stream import MetricsStream
from services.coordinator.prepare_state import (
    ClusterBaseRead,
    ForgetLink,
    LinkAsked,
    MeasureLink,
    NoteWaiting,
    Prep,
    PrepLimits,
    ProfileFacts,
    ProfilesRead,
    ReadClusterBase,
    ReadProfiles,
    StoreCluster,
    StoreLinks,
    fail,
)
from services.coordinator.prepare_state import Command as PrepCommand
from services.coordinator.recovery import (
    MemoryInputs,
    RecoveryImpossible,
    capacities,
    memory_inputs,
)

__all__ = ["LEDGER_MAX", "STREAM_MAX", "Effects", "prep_limits"]

log = get_logger(__name__)
T = TypeVar("T")
LEDGER_MAX = 1_000_000
"""Entries the sample ledger keeps (one per committed round and recovery)."""
STREAM_MAX = 10_000
"""Entries the events stream keeps (the store's default cap)."""

Shared = Send | Record | Log | StorePlan | SetAssigned
"""Commands both cores give."""


def prep_limits(coord: Host) -> PrepLimits:
    """What bounds a preparation's waits, from the coordinator's settings."""
    s = coord.settings
    return PrepLimits(
        join_timeout_s=s.join_timeout_s,
        probe_timeout_s=s.probe_timeout_s,
        profile_timeout_s=s.profile_timeout_s,
        plan_timeout_s=s.plan_timeout_s,
        heartbeat_s=s.heartbeat_s,
        heartbeat_misses=s.heartbeat_misses,
        link_probe_bytes=s.link_probe_bytes,
        link_probe_timeout_s=s.link_probe_timeout_s,
        link_bandwidth=s.link_bandwidth,
        endpoint=coord.endpoint,
    )


class Effects:
    """One job's effects: its records, plans, profiles, links, checkpoints and metrics."""

    def __init__(
        self,
        coord: Host,
        job: JobSpec,
        record: Callable[[JobState, Mapping[str, Any], bool], None],
        stream: MetricsStream | None,
    ) -> None:
        self.coord, self.job, self.jid = coord, job, job.job_id
        self.store = coord.store
        self.record = record
        """Moves the job's lifecycle state (`JobRun.recorded`; True: tried `once`)."""
        self.stream = stream
        self.cluster: ClusterSpec | None = None
        """The cluster the job was last planned for (none yet, or resumed: read from Redis)."""

    def once(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, a training step's Redis step, tried once: an outage raises `held.Away`."""
        return once(self.store, what, op)

    def shared(self, cmd: Shared | SendProbe | Heard, tried_once: bool = False) -> None:
        """Carry out a command either core gives (the training core's: Redis `tried_once`)."""
        coord, store, jid = self.coord, self.store, self.jid
        if isinstance(cmd, Send):  # an Assign carries the neighbour timeout in force
            coord.send(cmd.device, coord.timeouts.stamped(cmd.msg))
        elif isinstance(cmd, SendProbe | Heard | Log):
            coord.carry_out(cmd)
        elif isinstance(cmd, Record):
            self.record(cmd.state, cmd.fields, tried_once)
        elif isinstance(cmd, StorePlan):
            if tried_once:
                self.once("storing the plan", lambda: put_plan(store, jid, cmd.plan))
            else:
                coord.durable("storing the plan", lambda: put_plan(store, jid, cmd.plan))
        else:
            coord.assigned = cmd.devices

    # --- preparation ---------------------------------------------------------------

    def prepared(self, prep: Prep, commands: list[PrepCommand]) -> Prep:
        """Carry out a preparation's commands in order, feeding back what they answer.

        A re-plan's command that fails (the cluster file is invalid, Redis stayed
        away) fails that re-plan, not the running job.
        """
        todo = deque(commands)
        while todo:
            cmd = todo.popleft()
            if isinstance(cmd, Send | Record | Log | StorePlan | SetAssigned):
                self.shared(cmd)
                continue
            try:
                answer = self.prepare(cmd)
            except AsteroidError as exc:
                if not prep.replan:
                    raise
                return fail(prep, str(exc))[0]
            if answer is not None:
                prep, more = prepare.apply(prep, answer, time.monotonic())
                todo.extend(more)
        return prep

    def prepare(
        self,
        cmd: ReadProfiles
        | ReadClusterBase
        | MeasureLink
        | ForgetLink
        | StoreLinks
        | StoreCluster
        | NoteWaiting,
    ) -> ProfilesRead | ClusterBaseRead | LinkAsked | None:
        """Carry out a preparation command; the event it answers with, if any."""
        coord, store = self.coord, self.store
        if isinstance(cmd, NoteWaiting):
            wait = None if cmd.vetted is None else Waiting.of(cmd.vetted, cmd.need).model_dump()
            write = partial(write_job, store, self.jid, waiting=wait)
            coord.durable("recording the wait for workers", write)
            return None
        if isinstance(cmd, ReadProfiles):
            return ProfilesRead(
                coord.durable("reading the profiles", partial(self._facts, cmd.keys))
            )
        if isinstance(cmd, ReadClusterBase):
            return ClusterBaseRead(coord.cluster_base())
        if isinstance(cmd, MeasureLink):
            s = coord.settings
            nonce = coord.link_nonce(cmd.prober)
            req = links.request(
                nonce, cmd.target, cmd.addr, s.link_probe_bytes, s.link_probe_timeout_s
            )
            coord.send(cmd.prober, req)
            return LinkAsked(cmd.prober, req)
        if isinstance(cmd, ForgetLink):
            coord.links_pending.discard((cmd.prober, cmd.nonce))
        elif isinstance(cmd, StoreLinks):
            matrix = links.LinkMatrix(
                measured_at=time.time(),
                devices=list(cmd.devices),
                links=dict(cmd.links),
                errors=dict(cmd.errors),
            )
            doc = matrix.model_dump(mode="json")
            coord.durable("storing the link matrix", lambda: store.put_json(doc, *links.LINKS_KEY))
        else:
            self.cluster = cmd.cluster
            coord.durable("storing the cluster", lambda: put_cluster(store, self.jid, cmd.cluster))
        return None

    def _facts(self, keys: tuple[str, ...]) -> dict[str, ProfileFacts | None]:
        """The batch sizes and budget of each stored profile (None: none, or not a profile)."""
        out: dict[str, ProfileFacts | None] = {}
        for key in keys:
            data = self.store.get_json("profile", key)
            try:
                prof = None if data is None else Profile.model_validate(data)
            except ValidationError:
                prof = None
            out[key] = (
                None if prof is None else ProfileFacts(tuple(prof.batch_sizes), prof.memory_budget)
            )
        return out

    # --- training --------------------------------------------------------------------

    def train(
        self,
        cmd: Publish | Append | CheckStore | CommitCheckpoint,
    ) -> None:
        """Carry out a training command that answers nothing (an outage raises `held.Away`)."""
        store, jid = self.store, self.jid
        if isinstance(cmd, Publish):
            self._publish(cmd)
        elif isinstance(cmd, Append):
            maxlen = LEDGER_MAX if cmd.stream == "ledger" else STREAM_MAX
            entry = dict(cmd.entry)
            self.once(cmd.what, lambda: store.append(cmd.stream, jid, entry, maxlen=maxlen))
        elif isinstance(cmd, CheckStore):
            # leaders write to Redis; they wait out an outage themselves, but none need start in one
            self.once(cmd.what, store.probe)
        else:
            self._commit(cmd)

    def ask(
        self, cmd: RaiseEpoch | ReadCapacities | ReadCheckpoint
    ) -> EpochRaised | Capacities | CheckpointFound:
        """Carry out a training command whose answer the core waits for (an outage raises)."""
        store, jid = self.store, self.jid
        if isinstance(cmd, RaiseEpoch):
            return EpochRaised(self.once("raising the plan epoch", lambda: raise_plan_epoch(store)))
        if isinstance(cmd, ReadCapacities):
            return Capacities(*self.once("reading the job's profiles", self.capacities))
        found = self.once("finding the checkpoint", lambda: latest_round(store, jid))
        return CheckpointFound(found)

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

        self.once(f"committing the checkpoint of round {cmd.round}", commit)

    def capacities(
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
        """Update the job's hash and its metrics (and ledger) streams; an outage raises.

        The job goes on only once all are written: a round is committed when Redis
        says so, which is what makes an outage pause the job at a round boundary
        (the run holds what follows, `held.Held`).
        The metrics entry gets the wall-clock `time` of that commit (TensorBoard
        places the point there); with `metrics_dir`, the entry is copied to the
        job's files next.
        """
        store, jid = self.store, self.jid
        metrics: dict[str, Any] = dict(cmd.metrics)

        def write() -> None:
            metrics["time"] = now = time.time()
            entries = {"metrics": (metrics, STREAM_MAX)}
            if cmd.ledger is not None:
                entries["ledger"] = (dict(cmd.ledger), LEDGER_MAX)
            commit_round(store, jid, cmd.fields, entries, now)
            if cmd.ledger is not None:
                store.wait_durable()  # a round is committed once Redis has it on disk

        self.once(cmd.what, write)
        if self.stream is not None:
            self.stream.record(metrics)
