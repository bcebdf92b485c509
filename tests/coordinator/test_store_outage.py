"""A Redis outage mid-job, as events: the training core decides, the shell holds, nothing blocks.

The core (`driver.apply`, with `outages`) is fed `StoreDown` and `StoreBack`
on a fake clock by `test_driver.Script`; a job stands still while Redis is
away (its step neither times out nor looks hung), still finds a device lost
meanwhile, and fails naming Redis once the outage outlasts `redis_outage_s`.
`held.Held` is the shell's part: it holds the refused Redis step and every
command after it, tries it again at most once a second, and carries out what
it held, in order, once Redis answers; a `Shell` here plays it with a fake
Redis that is up or down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis

import common.logging
from common.errors import StoreUnavailable
from common.ids import DeviceId
from common.messages import Assigned, EvalDone, Heartbeat, Message, RoundDone, RunRound
from common.settings import CoordinatorSettings
from services.coordinator import driver, job_effects, jobs, outages
from services.coordinator.core import Beats, Heard, Log, Reply, SendProbe, Tick
from services.coordinator.driver import (
    Append,
    CheckStore,
    Command,
    CommitCheckpoint,
    Publish,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    Send,
    StorePlan,
)
from services.coordinator.held import Away, Held
from services.coordinator.in_force import InForce
from services.coordinator.jobs import JobRun
from services.coordinator.membership import Members, on_heartbeat
from services.coordinator.store_outage import StoreBack, StoreDown
from tests.coordinator.test_driver import (
    ALL,
    LIMITS,
    NO_CAPACITIES,
    PLAN,
    B,
    Script,
    job_of,
    phase_of,
    running,
)

WHERE = "redis://db:6379/0"
REFUSED = "Error 111 connecting to db:6379. Connection refused."
REDIS_STEPS = (Publish, Append, CheckStore, CommitCheckpoint, Record, StorePlan, RaiseEpoch)
"""Commands whose effect is a Redis step (ReadCapacities and ReadCheckpoint read Redis too)."""


def down(at: float, what: str = "committing round 0") -> StoreDown:
    return StoreDown(what, at, WHERE, REFUSED)


def outage_job(patience_s: float = 300.0) -> Script:
    """A job in round 0 at t=1 (every device heartbeating), riding out `patience_s` of outage."""
    s = running(job_of(total=4, checkpoint_every=0))
    s.run = replace(s.run, limits=replace(LIMITS, redis_outage_s=patience_s))
    return s


def rounds_started(commands: Sequence[Command]) -> list[int]:
    return sorted(
        {c.msg.round for c in commands if isinstance(c, Send) and isinstance(c.msg, RunRound)}
    )


def stand_still(s: Script, until: float) -> list[Command]:
    """The devices heartbeat without progress (idle: no round reached them) and time passes."""
    out: list[Command] = []
    while s.now < until:
        out += s.beat(ALL, at=s.now + 1.0, progress=False)
        out += s.feed(Tick())
    return out


# --- the core -----------------------------------------------------------------------


def test_a_job_stands_still_in_an_outage_and_starts_its_next_round_once_redis_is_back() -> None:
    s = outage_job()
    s.beat(ALL, at=2.0)
    committed = s.round_done(at=2.0)
    assert isinstance(committed[0], Publish) and committed[0].what == "committing round 0"
    assert rounds_started(committed) == [1]  # behind the commit: the shell holds them
    # the commit is refused: the core hears of it
    assert s.feed(down(2.0)) == [
        Log(
            "warning",
            "Redis unreachable; waiting for it",
            {
                "redis": WHERE,
                "waiting": "committing round 0",
                "patience_s": 300.0,
                "error": REFUSED,
            },
        )
    ]
    assert s.run.outage == down(2.0)
    # far past the watchdog (5 s) and the round's timeout (100 s): nothing moves, nothing fails
    assert stand_still(s, until=130.0) == []
    assert (s.run.phase, s.run.step, s.run.committed, s.run.ended) == ("round", 1, 1, False)
    # Redis is back: round 1's commands go out only now, and its clock starts now
    assert s.feed(StoreBack(), at=130.5) == [
        Log(
            "info",
            "Redis is back",
            {"redis": WHERE, "waited": "committing round 0", "after_s": 128.5},
        )
    ]
    assert s.run.outage is None and s.run.step_t0 == 130.5
    assert s.run.wait is not None and s.run.wait.started == 130.5
    s.beat(ALL, at=131.0)
    publish = s.round_done(at=132.5)[0]
    assert isinstance(publish, Publish) and publish.metrics["round_s"] == 2.0  # not 130.5


def test_without_the_outage_event_the_same_silence_is_a_hang() -> None:
    s = outage_job()
    s.beat(ALL, at=2.0)
    s.round_done(at=2.0)
    stand_still(s, until=10.0)
    assert s.run.phase == "recovering"  # the watchdog found them standing still


def test_an_outage_longer_than_the_patience_fails_the_job_naming_redis() -> None:
    s = outage_job(patience_s=30.0)
    s.beat(ALL, at=2.0)
    s.round_done(at=2.0)
    s.feed(down(2.0))
    stand_still(s, until=31.0)
    assert not s.run.ended  # 29 s: within the patience
    s.feed(Tick(), at=32.5)
    assert s.run.phase == "failed"
    assert s.run.outcome == (
        f"Redis at {WHERE} unreachable for 30.5 s while committing round 0 (patience 30 s): "
        + REFUSED
    )
    assert outages.gave_up(s.run)


def test_redis_back_before_the_patience_clears_the_outage_for_good() -> None:
    s = outage_job(patience_s=30.0)
    s.beat(ALL, at=2.0)
    s.round_done(at=2.0)
    s.feed(down(2.0))
    s.feed(StoreBack(), at=20.0)
    s.beat(ALL, at=40.0)
    s.feed(Tick())
    assert not s.run.ended and s.run.outage is None


def test_a_finished_job_whose_last_commit_is_held_fails_past_the_patience() -> None:
    s = outage_job(patience_s=30.0)
    for t in (2.0, 3.0, 4.0, 5.0):
        s.beat(ALL, at=t)
        s.round_done(at=t)

    def evaluated(d: DeviceId) -> EvalDone:
        return EvalDone(device=d, epoch=1, round=4, stage=PLAN.stage_of(d), samples=8)

    s.replies(evaluated, at=5.5)
    s.replies(s.saved, at=6.0)  # the last checkpoint: its commit is what Redis refuses
    assert s.run.phase == "finished"
    s.feed(down(6.0, "committing the checkpoint of round 4"))
    s.beat(ALL, at=35.0)
    s.feed(Tick())
    assert s.run.phase == "finished"  # within the patience: it may still land
    s.feed(Tick(), at=36.0)
    assert phase_of(s) == "failed"
    assert "while committing the checkpoint of round 4" in s.run.outcome


def test_a_device_lost_during_an_outage_is_found() -> None:
    s = outage_job()
    s.beat(ALL, at=2.0)
    s.round_done(at=2.0)
    s.feed(down(2.0))
    out = s.silence([B])
    assert [c.device for c in out if isinstance(c, SendProbe)] == [B]
    assert s.run.phase == "recovering"
    assert s.run.recovery is not None and s.run.recovery.lost == (B,)
    assert isinstance(out[-1], ReadCapacities)
    assert s.run.outage is not None  # still away: the recovery's steps are held too


# --- the shell's hold, with the core ------------------------------------------------


class Shell:
    """Plays `JobRun`: `Held` in front of the Script, Redis up or down, what was done in order."""

    def __init__(self, s: Script) -> None:
        self.s, self.up = s, True
        self.done: list[Command] = []
        self.tries: list[tuple[float, str]] = []
        self.held: Held[Command] = Held(
            self.do,
            self.s.feed,
            lambda c: isinstance(c, SendProbe | Heard | Log),
            clock=lambda: s.now,
        )

    def do(self, cmd: Command) -> list[Command]:
        if isinstance(cmd, (*REDIS_STEPS, ReadCapacities, ReadCheckpoint)):
            what = getattr(cmd, "what", type(cmd).__name__)
            self.tries.append((self.s.now, what))
            if not self.up:
                raise Away(what, WHERE, REFUSED)
        self.done.append(cmd)
        if isinstance(cmd, ReadCapacities):
            return self.s.feed(NO_CAPACITIES)
        return []  # the Script answers a RaiseEpoch itself

    def feed(self, commands: list[Command]) -> None:
        self.held.carry_out(commands)

    def tick(self, at: float, beating: Sequence[DeviceId] = ALL) -> None:
        """Time passes: `beating` heartbeat (idle), the held step is due again, the core ticks."""
        self.feed(self.s.beat(beating, at=at, progress=False))
        self.held.tick()
        self.feed(self.s.feed(Tick()))

    def steps(self) -> list[Command]:
        """What was carried out, but the logs and probes."""
        return [c for c in self.done if not isinstance(c, Log | SendProbe)]


def test_the_shell_holds_the_commit_and_what_follows_and_replays_them_in_order() -> None:
    s = outage_job()
    shell = Shell(s)
    s.beat(ALL, at=2.0)
    shell.up = False
    shell.feed(s.round_done(at=2.0))
    assert shell.steps() == [] and s.run.outage == down(2.0)
    assert rounds_started(shell.held.queue) == [1] and isinstance(shell.held.queue[0], Publish)
    for t in (2.25, 2.5, 2.75, 3.0, 3.5, 4.25):  # tried again at most once a second
        shell.tick(t)
    assert [t for t, _ in shell.tries] == [2.0, 3.0, 4.25]
    shell.up = True
    shell.tick(5.5)
    assert s.run.outage is None
    assert [t for t, _ in shell.tries] == [2.0, 3.0, 4.25, 5.5]
    done = shell.steps()
    assert isinstance(done[0], Publish)
    assert rounds_started(done[1:]) == [1]  # round 1 only after its predecessor's commit
    assert shell.held.idle


def test_a_loss_in_an_outage_probes_at_once_and_its_recovery_queues_behind_the_commit() -> None:
    s = outage_job()
    shell = Shell(s)
    s.beat(ALL, at=2.0)
    shell.up = False
    shell.feed(s.round_done(at=2.0))
    shell.feed(s.silence([B]))  # b goes silent during the outage; the probe is no Redis step
    assert [c.device for c in shell.done if isinstance(c, SendProbe)] == [B]
    assert s.run.phase == "recovering" and shell.steps() == []
    queued = [c for c in shell.held.queue if not isinstance(c, Log)]
    assert isinstance(queued[0], Publish)
    assert rounds_started(queued[1:5]) == [1]
    assert isinstance(queued[5], Record) and queued[5].state == "recovering"
    assert isinstance(queued[6], ReadCapacities) and len(queued) == 7
    shell.up = True
    shell.tick(s.now + 1.0, beating=[d for d in ALL if d != B])
    done = shell.steps()
    assert done[:7] == queued  # in the order the core gave them
    assert isinstance(done[7], ReadCheckpoint)  # the capacities answered: the recovery goes on
    assert s.run.outage is None and s.run.recovery is not None and s.run.recovery.plan is not None


def test_a_second_outage_during_the_replay_holds_again_from_where_it_stopped() -> None:
    s = outage_job()
    shell = Shell(s)
    first = [Append("recording a", "events", {"n": 1}), Append("recording b", "events", {"n": 2})]
    shell.up = False
    shell.feed(list(first))
    assert s.run.outage is not None
    s.now = 3.0
    shell.up = True
    calls = {"n": 0}
    original = shell.do

    def flaky(cmd: Command) -> list[Command]:  # a succeeds, then Redis goes again for b
        calls["n"] += 1
        if calls["n"] == 2:
            shell.up = False
        return original(cmd)

    shell.held.do = flaky
    shell.held.tick()
    assert shell.steps() == [first[0]]
    assert [c for c in shell.held.queue if not isinstance(c, Log)] == [first[1]]
    assert s.run.outage is not None and s.run.outage.what == "recording b"
    shell.held.do = original
    shell.up = True
    shell.tick(4.5)
    assert shell.steps() == first and s.run.outage is None


def test_a_refusal_is_no_outage_and_is_not_held() -> None:
    s = outage_job()

    def refuse(cmd: Command) -> list[Command]:
        raise RuntimeError("OOM command not allowed")

    held: Held[Command] = Held(refuse, s.feed, lambda c: False, clock=lambda: s.now)
    with pytest.raises(RuntimeError):
        held.carry_out([Append("recording", "events", {})])
    assert s.run.outage is None  # the run ends on it (StoreRefused): no outage, no retry


# --- the training shell itself: JobRun on a fake host whose Redis goes away -----------


class FakeStore:
    """The store's calls a training step makes, each one a Redis step of the host."""

    where = WHERE

    def __init__(self, host: FakeHost) -> None:
        self.host = host

    def append(self, stream: str, jid: str, entry: object, maxlen: int = 0) -> None:
        self.host.redis(f"append {stream}")

    def probe(self) -> None:
        self.host.redis("probe")

    def wait_durable(self) -> None:
        self.host.redis("wait durable")

    def incr(self, key: str) -> int:
        self.host.redis(f"incr {key}")
        return 1


class FakeHost:
    """What `JobRun` uses of the coordinator; Redis steps raise an outage while `down`."""

    def __init__(self) -> None:
        self.settings = CoordinatorSettings(redis_outage_s=60.0)
        self.endpoint = "tcp://127.0.0.1:5555"
        self.store = FakeStore(self)
        self.members: Members = {}
        self.assigned: frozenset[DeviceId] = frozenset()
        self.running: str | None = None
        self.collecting = False
        self.cancelled: dict[str, str] = {}
        self.drains: dict[DeviceId, str] = {}
        self.services: dict[str, float] = {}
        self.timeouts = InForce(self.settings, self.store, self.write_soon)
        self.down = False
        self.done: list[str] = []
        """What reached Redis or the socket, in order."""
        self.tries = 0

    def redis(self, what: str) -> None:
        self.tries += 1
        if self.down:
            raise redis.ConnectionError("Error 111 connecting. Connection refused.")
        self.done.append(what)

    def send(self, device: DeviceId, msg: Message) -> None:
        self.done.append(f"{type(msg).__name__} {getattr(msg, 'round', '')} to {device}")

    def write_state(self, jid: str, state: str, **extra: Any) -> None:
        self.redis(f"state {state}")

    def write_soon(self, what: str, op: Callable[[], object]) -> None:
        self.done.append(f"soon {what}")

    def carry_out(self, cmd: object) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The process's monotonic clock, as the test sets it; log context bound by a run dropped."""
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)
    monkeypatch.setattr(common.logging, "_GLOBAL", {})
    monkeypatch.setattr(jobs, "remove_orphans", lambda *_, **__: [])
    return fake


def job_run(host: FakeHost, patience_s: float) -> JobRun:
    """A JobRun of a two-round job whose training core starts on PLAN (no preparation)."""
    job = job_of(total=2, checkpoint_every=0)
    checked = SimpleNamespace(spec=job, job_id=job.job_id, rounds=2, layers=4, eval_size=0)
    run = JobRun(cast(Any, host), cast(Any, checked))
    limits = replace(LIMITS, redis_outage_s=patience_s)
    run.train, commands = driver.start(job, 2, 4, None, limits, PLAN, 0)
    members: Members = {}
    for d in ALL:
        members = on_heartbeat(
            members, Heartbeat(device=d, data_addr=f"tcp://{d}:1"), time.monotonic()
        )
    run.feed(Beats(members))
    run._carry_out(commands)
    return run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_job_run_holds_a_refused_commit_and_what_follows_then_replays_it_in_order(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    host = FakeHost()
    monkeypatch.setattr(
        job_effects, "commit_round", lambda store, jid, fields, *_: host.redis(f"commit {fields}")
    )
    run = job_run(host, patience_s=60.0)
    assert host.done[0] == "incr epoch" and host.done[-1] == "Assign  to d"
    host.done.clear()
    for d in ALL:
        run.feed(Reply(d, Assigned(device=d, epoch=1, round=0, param_bytes=1)))
    assert host.done[0] == "state running" and host.done[-1] == "RunRound 0 to d"
    host.done.clear()
    host.down, tries = True, host.tries
    for d in ALL:  # round 0 done; its commit is refused
        msg = RoundDone(device=d, epoch=1, round=0, stage=PLAN.stage_of(d), samples=8)
        run.feed(Reply(d, msg))
    assert host.done == [] and host.tries == tries + 1
    assert run.train is not None and run.train.outage is not None
    assert run.train.outage.what == "committing round 0"
    for t in (100.5, 101.5, 102.0):
        clock.now = t
        run.feed(Tick())
    assert host.tries == tries + 2  # at most once a second: at 101.5, not at 100.5 nor 102.0
    host.down = False
    clock.now = 103.0
    run.feed(Tick())
    assert run.train.outage is None and not run.ended
    assert host.done[0].startswith("commit {'round': 1") and host.done[1] == "wait durable"
    assert host.done[2:] == [f"RunRound 1 to {d}" for d in ALL]  # only after the commit


def test_the_job_run_fails_by_name_when_redis_stays_away(clock: Clock) -> None:
    host = FakeHost()
    run = job_run(host, patience_s=5.0)
    host.down = True
    run._carry_out([Append("recording a loss", "events", {"event": "x"})])
    assert run.train is not None and run.train.outage is not None and not run.ended
    clock.now = 106.0
    run.feed(Tick())
    assert run.ended
    with pytest.raises(StoreUnavailable, match=r"unreachable for 6\.0 s while recording a loss"):
        run.result()
    assert str(run.error).startswith(f"Redis at {WHERE} unreachable")
    assert host.done[-1] == "soon job j1 failed"
