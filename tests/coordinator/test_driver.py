"""The running job's core, driven by scripted events on a fake clock: no sockets, no Redis.

A small `Script` plays the shell: it feeds events at chosen times, keeps the
devices' heartbeats as the coordinator's pump would (`on_heartbeat`), and
answers RaiseEpoch with the next epoch, as Redis' INCR does. Every other
answered command (ReadCapacities, ReadCheckpoint, RequestPlan) is answered by
the test itself, so each step's commands are asserted as the shell sees them.

The plan is three stages, [a] [b] [c, d] over four layers: stage 0 backs up to
b, stage 1 to c, and the two-device last stage is its own replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from common.ids import DeviceId
from common.job import JobSpec
from common.lifecycle import JobState, advance
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    Collect,
    EvalDone,
    Heartbeat,
    Message,
    ReplicaSaved,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
    WorkerError,
)
from common.plan import Allocation, Plan, StageSpec
from common.zoo import ModelSpec
from services.coordinator.core import (
    Beats,
    Heard,
    Log,
    ProbeAnswer,
    Reply,
    SendProbe,
    Tick,
)
from services.coordinator.driver import (
    Append,
    Cancelled,
    Capacities,
    CheckpointFound,
    CheckStore,
    Command,
    CommitCheckpoint,
    EpochRaised,
    Event,
    Limits,
    PlanFailed,
    PlanReady,
    Publish,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    RequestPlan,
    Send,
    SetAssigned,
    StorePlan,
    apply,
    start,
)
from services.coordinator.membership import Members, heard, on_heartbeat

A, B, C, D = DeviceId("a"), DeviceId("b"), DeviceId("c"), DeviceId("d")
ALL = [A, B, C, D]
LAYERS = 4
LIMITS = Limits(
    round_timeout_s=100.0,
    heartbeat_deadline_s=1.5,
    probe_timeout_s=2.0,
    hung_min_s=5.0,
    hung_factor=3.0,
)
LOSS = {A: 0.5, B: 0.25, C: 1.25, D: 0.75}
"""Each device's summed loss in every round; only the last stage's count: the loss is 2.0."""
CORRECT = {C: 3, D: 2}
"""Each last-stage device's hits in every round: 5 of the global batch of 8."""
DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32
NO_CAPACITIES = Capacities(None, None, None)


def plan_of(*stages: tuple[int, int, list[DeviceId]], predicted_s: float | None = None) -> Plan:
    return Plan(
        stages=[
            StageSpec(start=lo, end=hi, devices=[Allocation(device=d) for d in devs])
            for lo, hi, devs in stages
        ],
        global_batch=8,
        microbatches=2,
        predicted_round_s=predicted_s,
    )


PLAN = plan_of((0, 1, [A]), (1, 2, [B]), (2, 4, [C, D]))


def job_of(total: int = 4, **fields: Any) -> JobSpec:
    defaults: dict[str, Any] = {"checkpoint_every": 2, "replicate_every": 2}
    return JobSpec(
        job_id="j1",
        model=ModelSpec(name="mlp", options={"hidden": 8, "depth": 1}),
        global_batch=8,
        rounds=total,
        **{**defaults, **fields},
    )


def addr(device: DeviceId) -> str:
    return f"tcp://{device}.lan:7000"


def lightweight_plan(*stages: tuple[int, int, list[DeviceId]]) -> Plan:
    """What the lightweight re-plan of PLAN must be: its stages moved, nothing predicted."""
    return plan_of(*stages).model_copy(update={"planner": "manual+lightweight"})


class Script:
    """The shell's part: feed events at times, keep heartbeats, answer RaiseEpoch.

    Like the coordinator, it counts a `Heard` as hearing from the device, so the
    next heartbeat snapshot it feeds carries the probe's answer.
    """

    def __init__(self, job: JobSpec, plan: Plan = PLAN, from_round: int = 0) -> None:
        self.now = 0.0
        self.redis_epoch = 0
        self.members: Members = {}
        self.progress: dict[DeviceId, int] = {}
        self.run, self.started = start(
            job, job.total_rounds(), LAYERS, None, LIMITS, plan, from_round
        )

    @property
    def epoch(self) -> int:
        return self.run.epoch

    def feed(self, event: Event, at: float | None = None) -> list[Command]:
        """Apply `event` at `at` (default: the current time); a RaiseEpoch is answered."""
        if at is not None:
            self.now = at
        if isinstance(event, EpochRaised):
            self.redis_epoch = event.epoch
        self.run, commands = apply(self.run, event, self.now)
        out = list(commands)
        for c in commands:  # the coordinator's membership counts an answered probe
            if isinstance(c, Heard):
                self.members = heard(self.members, c.device, c.at)
        if commands and isinstance(commands[-1], RaiseEpoch):
            self.redis_epoch += 1
            self.run, more = apply(self.run, EpochRaised(self.redis_epoch), self.now)
            out += more
        return out

    def beat(
        self, devices: Iterable[DeviceId], at: float | None = None, progress: bool = True
    ) -> list[Command]:
        """`devices` heartbeat at `at`, their progress counts moving unless told otherwise."""
        if at is not None:
            self.now = at
        for d in devices:
            self.progress[d] = self.progress.get(d, 0) + (1 if progress else 0)
            hb = Heartbeat(device=d, data_addr=addr(d), progress=self.progress[d])
            self.members = on_heartbeat(self.members, hb, self.now)
        return self.feed(Beats(self.members))

    def replies(
        self, make: Callable[[DeviceId], Message], at: float | None = None
    ) -> list[Command]:
        """Every device of the running plan replies with `make(device)`, in plan order."""
        if at is not None:
            self.now = at
        out: list[Command] = []
        for d in self.run.plan.devices:
            out += self.feed(Reply(d, make(d)))
        return out

    def assigned(self, at: float | None = None) -> list[Command]:
        epoch, step = self.epoch, self.run.step
        return self.replies(
            lambda d: Assigned(device=d, epoch=epoch, round=step, param_bytes=100), at
        )

    def done(self, d: DeviceId, epoch: int | None = None, round_no: int | None = None) -> RoundDone:
        return RoundDone(
            device=d,
            epoch=self.epoch if epoch is None else epoch,
            round=self.run.step if round_no is None else round_no,
            stage=self.run.plan.stage_of(d),
            samples=8,
            loss_sum=LOSS.get(d, 0.0),
            correct=CORRECT.get(d, 0),
        )

    def round_done(self, at: float | None = None) -> list[Command]:
        return self.replies(self.done, at)

    def saved(self, d: DeviceId, digest: str = DIGEST) -> CheckpointSaved:
        stage = self.run.plan.stage_of(d)
        return CheckpointSaved(
            device=d, epoch=self.epoch, round=self.run.step, layers=[], stage=stage, digest=digest
        )

    def silence(self, lost: Iterable[DeviceId]) -> list[Command]:
        """`lost` stop heartbeating now; the rest beat on. Ends when the probes time out.

        From the current time t: the others beat at t+1, the silent are probed at
        t+1.75 (past the 1.5 s deadline) and declared dead at t+4 (2.25 s after the
        probe, past the 2 s probe timeout). Times are binary fractions, so the
        silences the core computes are exact.
        """
        gone = set(lost)
        alive = [d for d in self.run.plan.devices if d not in gone]
        t = self.now
        out = self.beat(alive, at=t + 1.0)
        out += self.feed(Tick(), at=t + 1.75)
        out += self.beat(alive, at=t + 3.0)
        out += self.feed(Tick(), at=t + 4.0)
        return out


def running(job: JobSpec, plan: Plan = PLAN) -> Script:
    """A job whose devices all joined at t=0, assigned and in round 0 at t=1."""
    s = Script(job, plan)
    s.beat(plan.devices, at=0.0)
    s.feed(EpochRaised(1))
    s.beat(plan.devices, at=1.0)
    s.assigned()
    return s


def assigns(commands: Iterable[Command]) -> dict[DeviceId, Assign]:
    """The Assign each device was sent, by device, in the order sent."""
    return {c.device: c.msg for c in commands if isinstance(c, Send) and isinstance(c.msg, Assign)}


def phase_of(s: Script) -> str:
    """The job's phase now (a call, so a type checker does not narrow it across events)."""
    return s.run.phase


def run_rounds(s: Script, rounds: int, every_s: float = 2.0) -> None:
    """Commit `rounds` rounds, one every `every_s`, devices heartbeating before each commit."""
    for _ in range(rounds):
        s.beat(s.run.plan.devices, at=s.now + every_s / 2)
        s.round_done(at=s.now + every_s / 2)


# --- the happy path -----------------------------------------------------------


def test_start_marks_the_devices_assigned_and_raises_the_epoch() -> None:
    s = Script(job_of())
    assert s.started == [SetAssigned(frozenset(ALL)), RaiseEpoch()]
    assert s.run.phase == "assign" and s.run.committed == 0


def test_the_raised_epoch_assigns_every_device_its_stage_with_its_peers() -> None:
    job = job_of()
    s = Script(job, from_round=2)
    s.beat(ALL, at=0.0)
    commands = s.feed(EpochRaised(7))
    peers = {"a": "tcp://a.lan:7000", "b": "tcp://b.lan:7000", "c": "tcp://c.lan:7000"}
    peers["d"] = "tcp://d.lan:7000"
    assert commands == [
        Send(
            d,
            Assign(
                epoch=7,
                job=job,
                plan=PLAN,
                stage=stage,
                peers=peers,
                from_round=2,
                total_rounds=4,
                sources=None,
                sends={},
            ),
        )
        for d, stage in [(A, 0), (B, 1), (C, 2), (D, 2)]
    ]
    assert s.run.epoch == 7 and s.run.phase == "assign"


def test_assigned_from_all_records_running_and_starts_round_zero() -> None:
    s = Script(job_of())
    s.beat(ALL, at=0.0)
    s.feed(EpochRaised(1))
    partial = s.feed(Reply(A, Assigned(device=A, epoch=1, round=0, param_bytes=1)), at=1.0)
    assert partial == []
    rest = [
        c
        for d in (B, C, D)
        for c in s.feed(Reply(d, Assigned(device=d, epoch=1, round=0, param_bytes=1)))
    ]
    assert rest == [
        Record("running", {"epoch": 1, "round": 0, "total_rounds": 4}),
        *(Send(d, RunRound(epoch=1, round=0, keep=[], replicate=True)) for d in ALL),
    ]
    assert s.run.phase == "round" and s.run.step == 0


def test_a_round_done_from_all_publishes_the_loss_and_the_sample_ledger() -> None:
    s = running(job_of())
    s.now = 10.0  # the round was sent at t=1: it took 9 s
    commands = s.round_done()
    publish = commands[0]
    assert isinstance(publish, Publish)
    assert publish.what == "committing round 0"
    assert publish.fields == {"round": 1, "epoch": 1, "loss": 2.0, "samples_per_s": 8 / 9}
    assert publish.ledger == {
        "round": 0,
        "epoch": 1,
        "positions": [0, 8],
        "samples": list(range(8)),
    }
    assert (publish.metrics["loss"], publish.metrics["accuracy"]) == (2.0, 0.625)
    assert publish.metrics["round_s"] == 9.0
    assert set(publish.metrics["devices"]) == {"a", "b", "c", "d"}
    assert commands[1] == Log(
        "info", "round committed", {"round": 0, "loss": 2.0, "accuracy": 0.625, "round_s": 9.0}
    )
    # round 1 keeps the version round 0 replicated, and (every 2 rounds) does not replicate
    assert commands[2:] == [
        Send(d, RunRound(epoch=1, round=1, keep=[0], replicate=False)) for d in ALL
    ]
    assert s.run.committed == 1 and s.run.summary.losses == (2.0,)


def test_the_second_round_ledger_names_the_next_positions() -> None:
    s = running(job_of(checkpoint_every=0, total=6))
    run_rounds(s, 1)
    commands = s.round_done(at=s.now + 1.0)
    publish = commands[0]
    assert isinstance(publish, Publish)
    assert publish.ledger == {
        "round": 1,
        "epoch": 1,
        "positions": [8, 16],
        "samples": list(range(8, 16)),
    }
    assert commands[2:] == [
        Send(d, RunRound(epoch=1, round=2, keep=[0], replicate=True)) for d in ALL
    ]


def test_a_due_checkpoint_is_saved_then_committed_with_the_digests() -> None:
    s = running(job_of())
    run_rounds(s, 1)
    commands = s.round_done(at=s.now + 1.0)
    assert commands[2:] == [
        CheckStore("checkpointing round 2"),
        *(Send(d, SaveCheckpoint(epoch=1, round=2)) for d in ALL),
    ]
    assert s.run.phase == "checkpoint" and s.run.committed == 2
    commands = s.replies(s.saved, at=s.now + 0.5)
    digests = ({"a": DIGEST}, {"b": DIGEST}, {"c": DIGEST, "d": DIGEST})
    assert commands == [
        CommitCheckpoint(2, 4, digests, 2),
        *(Send(d, RunRound(epoch=1, round=2, keep=[0], replicate=True)) for d in ALL),
    ]
    assert s.run.summary.checkpoints == (2,)


def test_diverged_replica_digests_fail_the_job_naming_the_stage() -> None:
    s = running(job_of())
    run_rounds(s, 2)
    commands = s.replies(lambda d: s.saved(d, OTHER_DIGEST if d == D else DIGEST))
    assert commands == []
    assert s.run.phase == "failed" and s.run.ended
    assert s.run.outcome == (
        "checkpoint round 2: the replicas of stage 2 diverged, expected one state, got 2 "
        "(c hold abababababab; d hold cdcdcdcdcdcd)"
    )


def test_the_last_round_is_evaluated_checkpointed_and_finishes_the_job() -> None:
    s = running(job_of(total=2, checkpoint_every=0))
    run_rounds(s, 1)
    commands = s.round_done(at=s.now + 1.0)
    # eval_every 0 still evaluates after the last round: 512 held-out samples, batches of 8
    assert commands[2:] == [Send(d, RunEval(epoch=1, round=2, batches=64)) for d in ALL]

    def evaluated(d: DeviceId) -> EvalDone:
        return EvalDone(
            device=d,
            epoch=1,
            round=2,
            stage=s.run.plan.stage_of(d),
            samples=256 if d in (C, D) else 512,
            loss_sum={C: 100.0, D: 156.0}.get(d, 0.0),
            correct={C: 128, D: 64}.get(d, 0),
        )

    commands = s.replies(evaluated)
    assert commands[0] == Publish(
        "recording the evaluation of round 2",
        {"eval_loss": 0.5, "eval_accuracy": 0.375},
        {"round": 1, "eval_loss": 0.5, "eval_accuracy": 0.375, "eval_samples": 512},
    )
    assert commands[2:] == [
        CheckStore("checkpointing round 2"),
        *(Send(d, SaveCheckpoint(epoch=1, round=2)) for d in ALL),
    ]
    commands = s.replies(s.saved)
    digests = ({"a": DIGEST}, {"b": DIGEST}, {"c": DIGEST, "d": DIGEST})
    assert commands == [CommitCheckpoint(2, 4, digests, 2), Record("finished", {"round": 2})]
    assert s.run.phase == "finished" and s.run.ended
    assert s.run.summary.losses == (2.0, 2.0) and s.run.summary.evals == ((2, 0.5, 0.375),)
    ended = s.run
    assert s.feed(Reply(A, s.done(A))) == [] and s.run is ended


# --- stale replies and worker errors -------------------------------------------


def test_a_late_round_done_of_an_old_epoch_or_round_is_ignored() -> None:
    s = running(job_of())
    before = s.run
    for late in (s.done(A, epoch=0), s.done(A, round_no=5)):
        commands = s.feed(Reply(A, late))
        assert commands == [Log("debug", "ignored stale reply", {"peer": A, "type": "round_done"})]
    assert s.run == before


def test_a_worker_error_of_the_current_epoch_fails_the_job_naming_the_worker() -> None:
    s = running(job_of())
    error = WorkerError(device=C, epoch=1, round=0, error="out of memory")
    assert s.feed(Reply(C, error)) == []
    assert s.run.phase == "failed"
    assert s.run.outcome == "worker c failed in round 0: out of memory"


def test_a_worker_error_of_an_older_epoch_is_ignored() -> None:
    s = running(job_of())
    before = s.run
    error = WorkerError(device=C, epoch=0, round=0, error="out of memory")
    commands = s.feed(Reply(C, error))
    assert commands == [Log("debug", "ignored stale reply", {"peer": C, "type": "worker_error"})]
    assert s.run == before and s.run.phase == "round"


# --- detection inside a step -----------------------------------------------------


def test_a_silent_device_is_probed_after_the_heartbeat_deadline() -> None:
    s = running(job_of())  # everyone last heard from at t=1
    s.beat([A, C, D], at=2.0)
    assert s.feed(Tick(), at=2.5) == []  # b silent 1.5 s: not past the deadline
    assert s.feed(Tick(), at=2.6) == [SendProbe(B, 1, 1.6)]
    assert s.feed(Tick(), at=2.7) == []  # one probe per suspect


def test_an_answered_probe_counts_as_hearing_from_the_device() -> None:
    s = running(job_of())
    s.beat([A, C, D], at=2.0)
    s.feed(Tick(), at=2.6)
    commands = s.feed(ProbeAnswer(B, 1), at=3.0)
    assert commands == [Heard(B, 3.0), Log("info", "suspect answered the probe", {"device": B})]
    s.beat([A, C, D], at=4.0)
    assert s.feed(Tick(), at=4.5) == [] and s.run.phase == "round"


def test_a_probe_left_unanswered_begins_recovery() -> None:
    s = running(job_of())
    s.now = 1.0
    commands = s.silence([B])
    reason = (
        "workers ['b'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
        "while the coordinator waited for RoundDone of round 0"
    )
    assert commands == [
        SendProbe(B, 1, 1.75),
        Log("warning", "devices lost; recovering", {"lost": [B], "round": 0}),
        Record("recovering", {"lost": [B], "round": 0, "reason": reason}),
        ReadCapacities(),
    ]
    assert s.run.phase == "recovering" and s.run.wait is None


def test_a_probe_answer_after_the_device_was_declared_dead_is_ignored() -> None:
    s = running(job_of())
    s.now = 1.0
    s.silence([B])
    before = s.run
    commands = s.feed(ProbeAnswer(B, 1), at=5.0)
    assert commands == [
        Log("info", "ignored a probe answer nobody waits for", {"device": B, "nonce": 1})
    ]
    assert s.run == before


# --- recovery from the survivors' replicas ---------------------------------------


def in_round_three_with_replicas(**fields: Any) -> Script:
    """Rounds 0-2 committed (6 in all), replicas of versions 0 and 2 reported; round 3 runs.

    Replication runs every 2 rounds, so the newest replicas (version 2) are one
    round behind the committed 3: a lost single-device stage rolls everyone back.
    """
    s = running(job_of(total=6, checkpoint_every=0, **fields))

    def report(version: int) -> None:
        for holder, origin, lo, hi in ((B, A, 0, 1), (C, B, 1, 2)):
            msg = ReplicaSaved(
                device=holder, epoch=1, version=version, origin=origin, start=lo, end=hi
            )
            assert s.feed(Reply(holder, msg)) == []

    report(0)
    run_rounds(s, 2)
    report(2)
    run_rounds(s, 1)
    s.beat(ALL)
    assert s.run.committed == 3 and s.run.step == 3 and s.now == 7.0
    return s


NEW_PLAN = lightweight_plan((0, 1, [A]), (1, 4, [C, D]))
"""PLAN without b: capacities 1 and 2, four equal layers, so a takes 1 and c, d take 3."""


def test_losing_a_backed_up_stage_rolls_back_to_the_replicas_cut() -> None:
    s = in_round_three_with_replicas()
    s.silence([B])
    commands = s.feed(NO_CAPACITIES, at=11.25)
    assert commands[:4] == [
        Append("recording the rollback", "ledger", {"rollback_to": 2, "lost": ["b"]}),
        StorePlan(NEW_PLAN),
        SetAssigned(frozenset({A, C, D})),
        RaiseEpoch(),
    ]
    sent = assigns(commands[4:])
    assert len(commands) == 7 and list(sent) == [A, C, D]
    # c already holds b's layer 1 as its replica; d fetches it from c; nothing else moves
    got = {d: (m.epoch, m.stage, m.from_round, m.sources, m.sends) for d, m in sent.items()}
    assert got == {
        A: (2, 0, 2, {}, {}),
        C: (2, 1, 2, {}, {D: [1]}),
        D: (2, 1, 2, {1: C}, {}),
    }
    peers = {"a": "tcp://a.lan:7000", "c": "tcp://c.lan:7000", "d": "tcp://d.lan:7000"}
    assert all(m.peers == peers for m in sent.values())


def test_a_recovered_job_records_the_recovery_and_replays_from_the_cut() -> None:
    s = in_round_three_with_replicas()
    s.silence([B])  # lost at t=11
    s.feed(NO_CAPACITIES, at=11.25)
    commands = s.assigned(at=12.5)
    record = {
        "kind": "recovery",
        "lost": ["b"],
        "joined": [],
        "left": [],
        "reason": (
            "workers ['b'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
            "while the coordinator waited for RoundDone of round 3"
        ),
        "failed_round": 3,
        "from_round": 2,
        "replayed": 1,
        "source": "replicas",
        "moved_layers": 1,
        "moved_bytes": 1,
        "seconds": 1.5,
        "replan_s": 0.25,
        "migrate_s": 1.25,
        "recovery": "lightweight",
        "stages": [[0, 1, ["a"]], [1, 4, ["c", "d"]]],
    }
    assert commands == [
        Append("recording the recovery", "events", {"event": "recovered", **record}),
        Log("info", "recovered", record),
        Record("running", {"epoch": 2, "round": 2, "total_rounds": 6}),
        *(Send(d, RunRound(epoch=2, round=2, keep=[], replicate=True)) for d in (A, C, D)),
    ]
    assert s.run.committed == 2 and s.run.recovery is None and s.run.plan == NEW_PLAN
    assert s.run.summary.losses == (2.0, 2.0)  # round 2's report is replayed


def test_losing_a_stage_and_its_backup_holder_resumes_from_the_checkpoint() -> None:
    s = in_round_three_with_replicas()
    commands = s.silence([B, C])
    lost = [c for c in commands if isinstance(c, Record)]
    assert len(lost) == 1 and lost[0].fields["lost"] == [B, C]
    assert s.feed(NO_CAPACITIES, at=11.25) == [ReadCheckpoint()]
    commands = s.feed(CheckpointFound(2))
    survivors = lightweight_plan((0, 2, [A]), (2, 4, [D]))
    assert commands[:4] == [
        Append("recording the rollback", "ledger", {"rollback_to": 2, "lost": ["b", "c"]}),
        StorePlan(survivors),
        SetAssigned(frozenset({A, D})),
        RaiseEpoch(),
    ]
    got = {d: (m.stage, m.from_round, m.sources, m.sends) for d, m in assigns(commands).items()}
    assert len(commands) == 6 and got == {A: (0, 2, None, {}), D: (1, 2, None, {})}
    recovered = s.assigned(at=12.0)[0]
    assert isinstance(recovered, Append)
    picked = {k: recovered.entry[k] for k in ("source", "from_round", "replayed", "moved_layers")}
    assert picked == {"source": "checkpoint", "from_round": 2, "replayed": 1, "moved_layers": 4}


def test_no_replica_and_no_checkpoint_fails_the_job() -> None:
    s = in_round_three_with_replicas()
    s.silence([B, C])
    s.feed(NO_CAPACITIES, at=11.25)
    assert s.feed(CheckpointFound(None)) == []
    assert s.run.phase == "failed"
    assert s.run.outcome == (
        "workers ['b', 'c'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
        "while the coordinator waited for RoundDone of round 3; no replica or checkpoint of "
        "job j1 to resume the survivors from"
    )


# --- several failures -----------------------------------------------------------


def test_two_devices_lost_in_one_round_are_one_recovery_naming_both() -> None:
    s = in_round_three_with_replicas()
    commands = s.silence([A, B])
    assert [type(c) for c in commands] == [SendProbe, SendProbe, Log, Record, ReadCapacities]
    assert commands[2] == Log("warning", "devices lost; recovering", {"lost": [A, B], "round": 3})
    assert s.run.recovery is not None and s.run.recovery.lost == (A, B)


def test_a_loss_during_the_recovery_is_one_recovery_from_the_checkpoint() -> None:
    s = in_round_three_with_replicas()
    s.silence([B])  # lost at t=11
    s.feed(NO_CAPACITIES, at=11.25)  # assigns a, c, d from the replicas' cut
    s.beat([A, C, D], at=12.0)
    commands = s.silence([D])  # d goes silent while the others load their stages
    first = (
        "workers ['b'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
        "while the coordinator waited for RoundDone of round 3"
    )
    second = (
        "workers ['d'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
        "while the coordinator waited for Assigned of round 2"
    )
    assert commands == [
        SendProbe(D, 2, 1.75),
        Log("warning", "devices lost; recovering", {"lost": [B, D], "round": 3}),
        ReadCapacities(),
    ]
    rec = s.run.recovery
    assert rec is not None and (rec.lost, rec.reason, rec.from_peers) == (
        (B, D),
        f"{first}; {second}",
        False,
    )
    # devices may already hold their new layers: only the checkpoint is a common version
    assert s.feed(NO_CAPACITIES, at=17.0) == [ReadCheckpoint()]
    commands = s.feed(CheckpointFound(2))
    # re-planned from the plan under way (a, then c and d), now without d
    replanned = plan_of((0, 2, [A]), (2, 4, [C])).model_copy(
        update={"planner": "manual+lightweight+lightweight"}
    )
    assert commands[:4] == [
        Append("recording the rollback", "ledger", {"rollback_to": 2, "lost": ["b", "d"]}),
        StorePlan(replanned),
        SetAssigned(frozenset({A, C})),
        RaiseEpoch(),
    ]
    assert [m.sources for m in assigns(commands).values()] == [None, None]


def first_assignment_lost_b() -> tuple[Script, list[Command]]:
    """b goes silent before it ever loaded its stage; the commands of the whole job."""
    s = Script(job_of())
    out = s.beat(ALL, at=0.0)
    out += s.feed(EpochRaised(1))
    out += s.silence([B])
    out += s.feed(NO_CAPACITIES, at=4.5)
    return s, out


def test_a_loss_during_the_first_assignment_resumes_from_the_checkpoint() -> None:
    s, out = first_assignment_lost_b()
    assert out[-1] == ReadCheckpoint()  # nothing ran yet: no replica exists
    commands = s.feed(CheckpointFound(0))
    assert commands[:4] == [
        Append("recording the rollback", "ledger", {"rollback_to": 0, "lost": ["b"]}),
        StorePlan(NEW_PLAN),
        SetAssigned(frozenset({A, C, D})),
        RaiseEpoch(),
    ]
    commands = s.assigned(at=5.0)
    assert commands[2] == Record("running", {"epoch": 2, "round": 0, "total_rounds": 4})


def test_the_records_of_a_loss_during_the_first_assignment_follow_the_lifecycle() -> None:
    # the shell advances its lifecycle by every Record: planning -> recovering would fail the job
    s, out = first_assignment_lost_b()
    s.feed(CheckpointFound(0))
    out += s.assigned(at=5.0)
    state: JobState = "planning"  # the shell's state when the core starts
    for record in (c for c in out if isinstance(c, Record)):
        state = advance(state, record.state)
    assert state == "running"


def test_a_loss_during_the_final_checkpoint_still_commits_it_before_finishing() -> None:
    # resumed at the last round, the job must not finish without its final checkpoint
    s = running(job_of(total=2, checkpoint_every=0))
    run_rounds(s, 2)

    def evaluated(d: DeviceId) -> EvalDone:
        return EvalDone(device=d, epoch=1, round=2, stage=PLAN.stage_of(d), samples=512)

    commands = s.replies(evaluated, at=s.now + 0.5)
    assert commands[2] == CheckStore("checkpointing round 2")
    for d in (A, B, C):
        assert s.feed(Reply(d, s.saved(d))) == []
    s.silence([D])  # d dies before its part of checkpoint 2 is written
    s.feed(NO_CAPACITIES)  # c survives in its group: everyone resumes from round 2 itself
    commands = s.assigned(at=s.now + 1.0)
    assert Record("finished", {"round": 2}) not in commands
    assert commands[-3:] == [Send(d, SaveCheckpoint(epoch=2, round=2)) for d in (A, B, C)]


# --- what recovery the job asked for -----------------------------------------------


def test_recovery_none_fails_the_job_with_the_loss_reason() -> None:
    s = running(job_of(recovery="none"))
    s.now = 1.0
    commands = s.silence([B])
    assert commands == [SendProbe(B, 1, 1.75)]
    assert s.run.phase == "failed"
    assert s.run.outcome == (
        "workers ['b'] missed heartbeats for 4.0 s and did not answer a probe within 2 s "
        "while the coordinator waited for RoundDone of round 0"
    )


def heavy_after_losing_b() -> Script:
    s = in_round_three_with_replicas(recovery="heavy")
    s.silence([B])
    assert s.feed(NO_CAPACITIES, at=11.25) == [RequestPlan(frozenset({A, C, D}))]
    return s


HEAVY_PLAN = plan_of((0, 2, [A]), (2, 4, [C, D]))


def test_heavy_recovery_gathers_every_layer_of_the_cut_once() -> None:
    s = heavy_after_losing_b()
    commands = s.feed(PlanReady(HEAVY_PLAN), at=12.0)
    # layer 0 from a, layer 1 from c's replica of b, layers 2-3 spread over c and d
    assert commands == [
        Send(A, Collect(epoch=1, version=2, layers=[0])),
        Send(C, Collect(epoch=1, version=2, layers=[1, 3])),
        Send(D, Collect(epoch=1, version=2, layers=[2])),
    ]
    assert s.run.phase == "collect" and s.run.step == 2


def test_heavy_recovery_commits_the_gathered_checkpoint_then_resumes() -> None:
    s = heavy_after_losing_b()
    s.feed(PlanReady(HEAVY_PLAN), at=12.0)
    out: list[Command] = []
    for d in (A, C, D):
        stage = PLAN.stage_of(d)
        saved = CheckpointSaved(device=d, epoch=1, round=2, layers=[], stage=stage, digest=DIGEST)
        out += s.feed(Reply(d, saved), at=13.0)
    assert out[:5] == [
        CommitCheckpoint(2, 4, None, 2),
        Append("recording the rollback", "ledger", {"rollback_to": 2, "lost": ["b"]}),
        StorePlan(HEAVY_PLAN),
        SetAssigned(frozenset({A, C, D})),
        RaiseEpoch(),
    ]
    got = [(m.epoch, m.from_round, m.sources) for m in assigns(out).values()]
    assert got == [(2, 2, None)] * 3


def test_heavy_recovery_fails_when_the_planner_cannot_plan() -> None:
    s = heavy_after_losing_b()
    assert s.feed(PlanFailed("no planner service"), at=12.0) == []
    assert s.run.phase == "failed"
    assert s.run.outcome.endswith("; cannot re-plan on ['a', 'c', 'd']: no planner service")


def test_a_replan_that_ends_after_a_cancel_ends_the_job_cancelled() -> None:
    s = heavy_after_losing_b()
    s.feed(Cancelled("stop it"), at=11.5)
    assert s.run.phase == "recovering"  # the re-plan is under way
    assert s.feed(PlanFailed("cancelled: stop it"), at=12.0) == []
    assert s.run.phase == "cancelled" and s.run.outcome == "stop it"


def test_a_recovery_input_outside_a_recovery_is_ignored() -> None:
    s = running(job_of())
    before = s.run
    commands = s.feed(CheckpointFound(2))
    assert commands == [Log("debug", "ignored a recovery input", {"type": "CheckpointFound"})]
    assert s.run == before


# --- cancel, hung, replica reports -------------------------------------------------


def test_a_cancel_takes_effect_after_the_round_in_flight_is_committed() -> None:
    s = running(job_of())
    commands = s.feed(Cancelled("stopped by op"), at=2.0)
    assert commands == [Log("info", "job cancel noted", {"reason": "stopped by op"})]
    assert phase_of(s) == "round"
    commands = s.round_done(at=3.0)
    assert [type(c) for c in commands] == [Publish, Log]
    assert s.run.phase == "cancelled" and s.run.outcome == "stopped by op"
    assert s.run.committed == 1 and s.run.ended


def test_a_device_heartbeating_without_progress_is_hung_after_the_watchdog() -> None:
    # watchdog: max(5 s, 3 x the predicted 2 s round) = 6 s from the round's start at t=1
    s = running(job_of(), plan_of((0, 1, [A]), (1, 2, [B]), (2, 4, [C, D]), predicted_s=2.0))
    for t in (2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        s.beat([A, C, D], at=t)
        s.beat([B], progress=False)
        assert s.feed(Tick()) == []
    commands = s.feed(Tick(), at=7.1)
    reason = "worker b heartbeats but made no progress for 6 s in round 0 (watchdog)"
    assert commands == [
        Log("warning", "devices lost; recovering", {"lost": [B], "round": 0}),
        Record("recovering", {"lost": [B], "round": 0, "reason": reason}),
        ReadCapacities(),
    ]


def test_a_replica_report_from_a_device_that_is_not_the_backup_is_ignored() -> None:
    s = running(job_of())
    before = s.run
    msg = ReplicaSaved(device=D, epoch=1, version=0, origin=B, start=1, end=2)
    assert s.feed(Reply(D, msg)) == [
        Log(
            "warning",
            "ignored replica report",
            {"peer": D, "reason": "d is not the backup node of stage 1"},
        )
    ]
    assert s.run == before
