"""One job from submission to its end: profiling, planning, rounds, evaluation, checkpoints.

`JobRun` records every lifecycle transition in Redis (`job:<id>` hash and
the `events` stream) and every committed round in the `metrics` stream.
Rounds are committed only when every device reported; a cancel takes effect
at the next round boundary, so no half-applied round survives it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn

from common.checkpoint import check_replicas, commit_checkpoint, latest_round, save_stage
from common.errors import AsteroidError, CheckpointError, ConfigError, StoreUnavailable
from common.ids import DeviceId
from common.job import JobSpec
from common.job_data import eval_size, sample_indices, train_size
from common.ledger import rollback_entry, round_entry
from common.lifecycle import TERMINAL, JobState, advance
from common.logging import bind_global, get_logger
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    EvalDone,
    PlanRequest,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
)
from common.plan import Plan
from common.profile import ClusterSpec, load_profiles
from common.secrets import mask_text
from common.store import OUTAGE
from common.zoo import build_model
from services.coordinator.membership import Members
from services.coordinator.profiling import cluster_for, profile_budgets, profile_workers
from services.coordinator.recovery import (
    MemoryInputs,
    RecoveryImpossible,
    capacities,
    memory_inputs,
    survivors_plan,
)

if TYPE_CHECKING:
    from services.coordinator.service import Coordinator

__all__ = ["DeviceLost", "JobCancelled", "JobFailed", "JobRun", "JobSummary"]

log = get_logger(__name__)
LEDGER_MAX = 1_000_000
"""Entries the sample ledger keeps (one per committed round and recovery)."""


class JobFailed(AsteroidError):
    """The job cannot continue; the message says which worker and why."""


class DeviceLost(JobFailed):
    """Devices of the running plan are gone (dead after an unanswered probe, or hung).

    The job recovers from it on the survivors when its spec allows, else fails
    with this message.
    """

    def __init__(self, devices: list[DeviceId], why: str) -> None:
        super().__init__(why)
        self.devices = sorted(devices)


class JobCancelled(AsteroidError):
    """Someone cancelled the job; its last committed checkpoint stays."""


@dataclass
class JobSummary:
    """What a finished job reports."""

    job_id: str
    rounds: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    max_alive: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    """Per device, the most bytes it held at once in a round: task pool plus kept activations."""
    checkpoints: list[int] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(round, held-out loss, held-out accuracy) after each evaluation."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """One record per recovery: devices lost, round resumed from, rounds replayed, seconds."""

    def rollback(self, start: int, to_round: int) -> None:
        """Forget what rounds `to_round` and later reported (they are replayed)."""
        keep = max(0, to_round - start)
        del self.losses[keep:], self.accuracies[keep:], self.round_s[keep:]
        self.checkpoints = [c for c in self.checkpoints if c <= to_round]
        self.evals = [e for e in self.evals if e[0] <= to_round]


class JobRun:
    """Drives one job through its lifecycle on a coordinator's workers."""

    def __init__(self, coord: Coordinator, job: JobSpec, total_rounds: int | None = None) -> None:
        self.coord, self.job, self.jid = coord, job, job.job_id
        self.total = total_rounds or job.total_rounds()
        self.state: JobState = "submitted"
        self.store = coord.store
        self.committed = 0
        """Rounds committed so far (the next round's number), for what a recovery replays."""
        self.train_size = train_size(job)
        """Samples of the training set (None: unbounded), for the sample ledger."""

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

    def run(self, plan: Plan | None = None, resume: bool = False) -> JobSummary:
        """Run the job to its end; with `plan`, skip profiling and planning.

        Raises:
            JobFailed, JobCancelled, ConfigError: after recording the end state.

        """
        bind_global(job=self.jid)
        self.coord.running = self.jid
        try:
            if plan is None:
                plan = self._plan()
            return self._train(plan, resume)
        except JobCancelled as exc:
            self.record("cancelled", reason=str(exc))
            raise
        except AsteroidError as exc:
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

    def _plan(self) -> Plan:
        """Profile the workers' devices (cached profiles reused), then ask the planner."""
        coord = self.coord
        coord.wait_for_count(self.job.min_workers, coord.settings.join_timeout_s)
        members = coord.alive()
        self.record("profiling", workers=sorted(members))
        return self._planned(members, "planning")

    def _planned(self, members: Members, state: JobState | None) -> Plan:
        """The planner's plan for `members` (profiled first; cached profiles reused)."""
        job, coord = self.job, self.coord
        if job.global_batch is None:
            raise ConfigError("global_batch: required when the planner makes the plan")
        settings = coord.settings
        keys = profile_workers(coord, job, members)
        base = coord.cluster_base()
        budgets = profile_budgets(coord, keys)
        cluster = cluster_for(members, keys, budgets, base, settings.link_bandwidth)
        self.store.put_json(cluster.model_dump(mode="json"), "cluster", self.jid)
        if state is not None:
            self.record(state, planner=job.planner)
        req = PlanRequest(
            job_id=self.jid,
            planner=job.planner,
            cluster=cluster,
            profiles=sorted(set(keys.values())),
            global_batch=job.global_batch,
            microbatches=job.microbatches or 1,
        )
        return coord.request_plan(req, settings.plan_timeout_s)

    # --- training --------------------------------------------------------------

    def _train(self, plan: Plan, resume: bool) -> JobSummary:
        job, jid, coord = self.job, self.jid, self.coord
        model = build_model(job.model, job.seed, coord.settings.model_modules).full()
        plan.validate_for(len(model))
        store = self.store
        coord.durable(
            "storing the plan", lambda: store.put_json(plan.model_dump(mode="json"), "plan", jid)
        )
        coord.wait_for_devices(plan.devices, coord.settings.join_timeout_s)
        start = (
            coord.durable("finding the checkpoint", lambda: latest_round(store, jid))
            if resume
            else None
        )
        if start is None:
            start = 0

            def initial() -> None:
                save_stage(store, jid, 0, model, None, 0)
                commit_checkpoint(store, jid, 0, len(model))

            coord.durable("saving the initial weights", initial)
        self.committed = start
        epoch = self._assign_all(plan, start)
        self.record("running", epoch=epoch, round=start, total_rounds=self.total)
        summary = JobSummary(job_id=jid, rounds=self.total)
        if job.eval_every and start == 0:
            self._evaluate(plan, epoch, 0, summary)  # the baseline the gain is measured from
        r = start
        lost: DeviceLost | None = None  # devices lost since the last recovery that succeeded
        while r < self.total:
            bind_global(round=r)
            coord.check_cancelled(jid)
            try:
                if lost is not None:
                    plan, epoch, r = self._recover(plan, lost, r, start, summary, len(model))
                    lost = None
                    continue
                self._step(plan, epoch, r, summary, model)
            except DeviceLost as more:  # another loss during a recovery adds to the first
                if job.recovery == "none":
                    raise
                lost = (
                    more
                    if lost is None
                    else DeviceLost([*lost.devices, *more.devices], f"{lost}; {more}")
                )
                continue
            r += 1
        self.record("finished", round=self.total)
        return summary

    def _step(
        self, plan: Plan, epoch: int, r: int, summary: JobSummary, model: nn.Sequential
    ) -> None:
        """Round `r`, then the evaluation and checkpoint due after it."""
        job = self.job
        self._round(plan, epoch, r, summary, model)
        done = r + 1
        if done == self.total or (job.eval_every and done % job.eval_every == 0):
            self._evaluate(plan, epoch, done, summary)
        if done == self.total or (job.checkpoint_every and done % job.checkpoint_every == 0):
            self._checkpoint(plan, epoch, done, len(model))
            summary.checkpoints.append(done)

    # --- recovery --------------------------------------------------------------

    def _recover(
        self,
        plan: Plan,
        lost: DeviceLost,
        r: int,
        start: int,
        summary: JobSummary,
        layers: int,
    ) -> tuple[Plan, int, int]:
        """Go on without the lost devices: a new plan, every stage from one version, replay.

        The round in flight is abandoned on every device (the new assignment aborts
        it, including groups that already stepped for it), and every stage resumes
        from the newest committed checkpoint v in Redis, so rounds v..r are replayed
        with the same samples: N committed rounds stay N single-device steps.
        Returns the new plan, its epoch and the round to run next.
        """
        job, coord, jid = self.job, self.coord, self.jid
        t0 = time.monotonic()
        gone = set(lost.devices)
        log.warning("devices lost; recovering", lost=lost.devices, round=r, reason=str(lost))
        if self.state != "recovering":
            self.record("recovering", lost=lost.devices, round=r, reason=str(lost))
        survivors = [d for d in plan.devices if d not in gone]
        try:
            if job.recovery == "heavy":  # the full planner, on every live device but the lost
                members = {d: m for d, m in coord.alive().items() if d not in gone}
                new_plan = self._planned(members, None)
            else:
                costs, speeds, memory = self._capacities()
                new_plan = survivors_plan(plan, gone, costs, speeds, memory)
            new_plan.validate_for(layers)
        except (RecoveryImpossible, ConfigError) as exc:
            raise JobFailed(f"{lost}; cannot re-plan on {survivors}: {exc}") from exc
        version = coord.durable("finding the checkpoint", lambda: latest_round(self.store, jid))
        if version is None:
            raise JobFailed(f"{lost}; no checkpoint of job {jid} to resume the survivors from")
        replayed = self.committed - version  # committed rounds that run again
        coord.durable(
            "recording the rollback",
            lambda: self.store.append(
                "ledger", jid, rollback_entry(version, [str(d) for d in gone]), maxlen=LEDGER_MAX
            ),
        )
        coord.durable(
            "storing the plan",
            lambda: self.store.put_json(new_plan.model_dump(mode="json"), "plan", jid),
        )
        coord.assigned = frozenset(new_plan.devices)
        epoch = self._assign_all(new_plan, version)
        self.committed = version
        summary.rollback(start, version)
        seconds = time.monotonic() - t0
        record = {
            "lost": [str(d) for d in lost.devices],
            "reason": str(lost),
            "failed_round": r,
            "from_round": version,
            "replayed": replayed,
            "seconds": round(seconds, 3),
            "recovery": job.recovery,
            "stages": [
                [st.start, st.end, [str(a.device) for a in st.devices]] for st in new_plan.stages
            ],
        }
        summary.recoveries.append(record)
        coord.durable(
            "recording the recovery",
            lambda: self.store.append("events", jid, {"event": "recovered", **record}),
        )
        self.record("running", epoch=epoch, round=version, total_rounds=self.total)
        log.info("recovered", **record)
        return new_plan, epoch, version

    def _capacities(
        self,
    ) -> tuple[list[float] | None, dict[DeviceId, float] | None, MemoryInputs | None]:
        """Layer costs, device speeds and memory inputs from the job's profiles; None if unknown.

        A device's budget is what its heartbeat reports, else what the planner was
        given for it, else 0 (unknown, so unlimited): the survivors' plan must fit
        the memory they really have, not just balance their speed.
        """
        stored = self.store.get_json("cluster", self.jid)
        if stored is None:
            return None, None, None
        cluster = ClusterSpec.model_validate(stored)
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

    def _assign_all(self, plan: Plan, start: int) -> int:
        """Give every device its stage under a new plan epoch; returns the epoch."""
        coord, s = self.coord, self.coord.settings
        epoch = int(
            coord.durable(
                "raising the plan epoch", lambda: self.store.r.incr(self.store.key("epoch"))
            )
        )
        peers = {str(d): coord.members[d].info.data_addr for d in plan.devices}
        for d in plan.devices:
            coord.send(
                d,
                Assign(
                    epoch=epoch,
                    job=self.job,
                    plan=plan,
                    stage=plan.stage_of(d),
                    peers=peers,
                    from_round=start,
                    total_rounds=self.total,
                ),
            )
        coord.gather(Assigned, plan.devices, epoch, start, s.round_timeout_s)
        return epoch

    def _round(
        self, plan: Plan, epoch: int, r: int, summary: JobSummary, model: nn.Sequential
    ) -> None:
        """Run round `r` on every device and commit it."""
        coord = self.coord
        t0 = time.perf_counter()
        for d in plan.devices:
            coord.send(d, RunRound(epoch=epoch, round=r))
        done = coord.gather(
            RoundDone,
            plan.devices,
            epoch,
            r,
            coord.settings.round_timeout_s,
            watchdog_s=coord.hung_watchdog_s(plan),
        )
        elapsed = time.perf_counter() - t0
        last = [a.device for a in plan.stages[-1].devices]
        loss = sum(done[d].loss_sum for d in last)
        acc = sum(done[d].correct for d in last) / plan.global_batch
        self._commit_round(r, epoch, loss, acc, elapsed, plan, done)
        summary.losses.append(loss)
        summary.accuracies.append(acc)
        summary.round_s.append(elapsed)
        for d, msg in done.items():
            summary.max_alive[d] = max(summary.max_alive.get(d, 0), msg.max_alive)
            summary.peak_bytes[d] = max(summary.peak_bytes.get(d, 0), msg.peak_bytes)

    def _commit_round(
        self,
        r: int,
        epoch: int,
        loss: float,
        acc: float,
        elapsed: float,
        plan: Plan,
        done: dict[DeviceId, RoundDone],
    ) -> None:
        """Record round `r` as committed: weights now belong to round r+1."""
        rate = plan.global_batch / elapsed
        lo, hi = r * plan.global_batch, (r + 1) * plan.global_batch
        samples = sample_indices(self.job.seed, self.train_size, lo, hi - lo)
        self._publish(
            f"committing round {r}",
            {
                "round": r + 1,
                "epoch": epoch,
                "loss": loss,
                "samples_per_s": rate,
                "updated": time.time(),
            },
            {
                "round": r,
                "epoch": epoch,
                "loss": loss,
                "accuracy": acc,
                "round_s": elapsed,
                "samples_per_s": rate,
                "devices": {
                    d: {
                        "stage": m.stage,
                        "max_alive": m.max_alive,
                        "peak_bytes": m.peak_bytes,
                        "peak_saved_bytes": m.peak_saved_bytes,
                        **m.timings.model_dump(),
                    }
                    for d, m in done.items()
                },
            },
            round_entry(r, epoch, lo, hi, samples),
        )
        self.committed = r + 1
        log.info(
            "round committed",
            loss=round(loss, 5),
            accuracy=round(acc, 3),
            round_s=round(elapsed, 3),
        )

    def _evaluate(self, plan: Plan, epoch: int, round_no: int, summary: JobSummary) -> None:
        """Held-out loss and accuracy of the weights of `round_no`, through the pipeline."""
        coord = self.coord
        batches = math.ceil(eval_size(self.job) / plan.global_batch)
        for d in plan.devices:
            coord.send(d, RunEval(epoch=epoch, round=round_no, batches=batches))
        done = coord.gather(
            EvalDone,
            plan.devices,
            epoch,
            round_no,
            coord.settings.round_timeout_s,
            watchdog_s=coord.hung_watchdog_s(plan),
        )
        last = [a.device for a in plan.stages[-1].devices]
        samples = sum(done[d].samples for d in last)
        loss = sum(done[d].loss_sum for d in last) / max(1, samples)
        acc = sum(done[d].correct for d in last) / max(1, samples)
        summary.evals.append((round_no, loss, acc))
        self._publish(
            f"recording the evaluation of round {round_no}",
            {"eval_loss": loss, "eval_accuracy": acc},
            {
                "round": round_no - 1,
                "eval_loss": loss,
                "eval_accuracy": acc,
                "eval_samples": samples,
            },
        )
        log.info("evaluated", round=round_no, eval_loss=round(loss, 4), eval_accuracy=round(acc, 3))

    def _checkpoint(self, plan: Plan, epoch: int, round_no: int, layers: int) -> None:
        """Have every device save its part, check that replicas agree, commit `round_no`.

        Leaders write the layers; every device sends its state's digest, so a
        replica that drifted from its leader fails the job instead of hiding.
        """
        coord = self.coord
        # leaders write to Redis; they wait out an outage themselves, but none need start in one
        coord.durable(f"checkpointing round {round_no}", self.store.r.ping)
        for d in plan.devices:
            coord.send(d, SaveCheckpoint(epoch=epoch, round=round_no))
        saved = coord.gather(
            CheckpointSaved,
            plan.devices,
            epoch,
            round_no,
            coord.settings.round_timeout_s,
            watchdog_s=coord.hung_watchdog_s(plan),
        )
        digests = [
            {str(a.device): saved[a.device].digest for a in st.devices} for st in plan.stages
        ]
        try:
            check_replicas(round_no, digests)
        except CheckpointError as exc:
            raise JobFailed(str(exc)) from exc

        def commit() -> None:
            commit_checkpoint(self.store, self.jid, round_no, layers, digests)
            self.store.append("events", self.jid, {"event": "checkpoint", "round": round_no})

        coord.durable(f"committing the checkpoint of round {round_no}", commit)

    def _publish(
        self,
        what: str,
        fields: dict[str, Any],
        metrics: dict[str, Any],
        ledger: dict[str, Any] | None = None,
    ) -> None:
        """Update the job's hash and its metrics (and ledger) streams, waiting out an outage.

        The job goes on only once all are written: a round is committed when Redis
        says so, which is what makes an outage pause the job at a round boundary.
        """

        def write() -> None:
            self.store.set_fields(fields, "job", self.jid)
            self.store.append("metrics", self.jid, metrics)
            if ledger is not None:
                self.store.append("ledger", self.jid, ledger, maxlen=LEDGER_MAX)

        self.coord.durable(what, write)
