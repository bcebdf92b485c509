"""Drive a seeded chaos schedule against a running job, and record what each event cost.

For each event: wait (bounded) until the job committed the event's gap of
rounds since it was last back, inject it through the backend, then wait
(bounded) until the job is back: for a failure, a drain or a join the
coordinator's `recovered`/`replanned` event naming the device and a committed
round after it; for the rest a committed round after the injection ended (a
hang that outlasted detection is a failure too, and waited for as one). The
record of each event says when it was injected, detected (`recovering`),
recovered, and the first commit after: the recovery time is injection to that
commit. Times are wall clock: Redis stamps stream entries with its clock, and
every process of a run shares this host's.

A `second_kill` is injected the moment the failure before it is seen
`recovering`, so it lands while that recovery is under way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis

from common.errors import StoreError
from common.plan import Plan
from common.store import Store
from tests.chaos.backend import REMOVING, Backend
from tests.chaos.sampler import Sample, Sampler
from tests.chaos.schedule import Event, Schedule

POLL_S = 0.05
START_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 90.0
DETECT_TIMEOUT_S = 30.0
REDIS_DOWN_S = 1.0
"""How long Redis stays away: long enough that writes really fail and are retried."""
REPLANNING = ("kill", "kill_stage", "second_kill", "join", "drain")


@dataclass
class EventRecord:
    """What happened to one scheduled event (times: wall clock, seconds; None: not seen)."""

    event: Event
    targets: list[str] = field(default_factory=list)
    injected: float | None = None
    injection_done: float | None = None
    detected: float | None = None
    recovered: float | None = None
    first_commit: float | None = None
    recovery: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        """Injection to the first committed round after the job was back."""
        if self.injected is None or self.first_commit is None:
            return None
        return self.first_commit - self.injected


@dataclass
class RunResult:
    schedule: Schedule
    job: dict[str, Any]
    records: list[EventRecord]
    samples: list[Sample]
    commits: list[tuple[float, dict[str, Any]]]
    events: list[tuple[float, dict[str, Any]]]
    exit_code: int | None
    started: float
    ended: float
    warm: float
    """When warm-up ended (the first commit): the growth check's baseline."""
    problems: list[str] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)
    """(time, 1-minute load average) samples of the machine."""


def _stamp(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


class Watch:
    """The job's committed rounds and coordinator events as last read (kept across outages)."""

    def __init__(self, backend: Backend, jid: str) -> None:
        self.backend, self.jid = backend, jid
        self.commits: list[tuple[float, dict[str, Any]]] = []
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.job: dict[str, Any] = {}
        self.plan: dict[str, Any] | None = None
        self._store: Store | None = None

    def refresh(self) -> bool:
        """Read again; False (keeping the last reading) while Redis does not answer."""
        try:
            if self._store is None:
                self._store = Store(self.backend.redis_url, self.backend.cluster)
            store = self._store
            self.commits = [
                (_stamp(i), e) for i, e in store.read_entries("metrics", self.jid) if "loss" in e
            ]
            self.events = [(_stamp(i), e) for i, e in store.read_entries("events", self.jid)]
            self.job = store.get_fields("job", self.jid)
            self.plan = store.get_json("plan", self.jid)
        except (redis.RedisError, StoreError, OSError):
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def commits_after(self, t: float) -> list[float]:
        return [ts for ts, _ in self.commits if ts > t]

    def first_event(self, t: float, test: Callable[[dict[str, Any]], bool]) -> float | None:
        return next((ts for ts, e in self.events if ts > t and test(e)), None)

    def find(self, t: float, test: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for ts, e in self.events if ts > t and test(e)), None)

    def plan_devices(self) -> list[list[str]]:
        """Each stage's devices in the running plan ([] before there is one)."""
        if self.plan is None:
            return []
        plan = Plan.model_validate(self.plan)
        return [[str(a.device) for a in st.devices] for st in plan.stages]

    def backup(self, stage: int) -> str | None:
        if self.plan is None:
            return None
        found = Plan.model_validate(self.plan).backup_of(stage)
        return None if found is None else str(found)


class Runner:
    """One chaos run: `run()` drives the schedule and returns what it recorded."""

    def __init__(
        self,
        backend: Backend,
        schedule: Schedule,
        job: dict[str, Any],
        plan: dict[str, Any] | None,
        devices: list[str],
        *,
        deadline: float,
        sample_period_s: float = 1.0,
        start_timeout_s: float = START_TIMEOUT_S,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        log: Callable[[str], None] = print,
    ) -> None:
        self.backend, self.schedule, self.job, self.plan = backend, schedule, job, plan
        self.devices = devices
        self.deadline = deadline
        self.watch = Watch(backend, str(job["job_id"]))
        self.sampler = Sampler(backend.pids, sample_period_s)
        self.gone: set[str] = set()
        self.log = log
        self.start_timeout_s, self.settle_timeout_s = start_timeout_s, settle_timeout_s

    def left(self, cap_s: float) -> float:
        return max(0.0, min(cap_s, self.deadline - time.time()))

    def _until(self, what: str, cap_s: float, test: Callable[[], bool]) -> bool:
        """Poll `test` (after a refresh) until true or `cap_s` (capped by the run's deadline)."""
        end = time.time() + self.left(cap_s)
        while True:
            self.watch.refresh()
            if test():
                return True
            if time.time() >= end:
                self.log(f"gave up waiting for {what} after {cap_s:.0f} s")
                return False
            time.sleep(POLL_S)

    def run(self) -> RunResult:
        started = time.time()
        self.backend.start(self.devices, self.job, self.plan)
        self.sampler.start()
        records: list[EventRecord] = []
        problems: list[str] = []
        warm = time.time()
        exit_code: int | None = None
        try:
            if not self._until("the first commit", self.start_timeout_s, self._running):
                problems.append("the job never committed a round")
            else:
                warm = time.time()
                records = self._drive(problems)
            exit_code = self.backend.coordinator_exit(self.left(600))
            if exit_code is None:
                problems.append("the coordinator did not exit before the run's deadline")
            self.watch.refresh()
        finally:
            samples = self.sampler.stop()
            self.watch.close()
        problems += [f"sampler: {e}" for e in self.sampler.errors[:5]]
        return RunResult(
            self.schedule,
            self.job,
            records,
            samples,
            self.watch.commits,
            self.watch.events,
            exit_code,
            started,
            time.time(),
            warm,
            problems,
            list(self.sampler.loads),
        )

    def _running(self) -> bool:
        return bool(self.watch.commits)

    def _drive(self, problems: list[str]) -> list[EventRecord]:
        records: list[EventRecord] = []
        back = time.time()
        events = list(self.schedule.events)
        for i, event in enumerate(events):
            if event.kind == "second_kill":
                continue  # injected with the failure before it
            gap = event.gap_rounds
            ok = self._until(
                f"{gap} rounds before event #{event.index}",
                self.settle_timeout_s,
                partial(self._gap_done, back, gap),
            )
            if self._over():
                problems.append(f"the job ended before event #{event.index}")
                break
            if not ok:
                problems.append(f"the job did not commit {gap} rounds before event #{event.index}")
                break
            rec = self._inject(event)
            records.append(rec)
            self.log(f"injected {event.describe()} on {rec.targets}")
            following = events[i + 1] if i + 1 < len(events) else None
            if following is not None and following.kind == "second_kill":
                records.append(self._second(rec, following))
            for pending in records[-2:] if following and following.kind == "second_kill" else [rec]:
                self._settle(pending)
                took = pending.recovery_s
                back_in = "not back" if took is None else f"back after {took:.2f} s"
                self.log(f"event #{pending.event.index}: {back_in}")
                if pending.first_commit is None:
                    problems.append(
                        f"event #{pending.event.index} ({pending.event.kind}): "
                        f"the job did not come back ({pending.note})"
                    )
            back = max((r.first_commit or time.time()) for r in records[-2:])
        return records

    def _gap_done(self, since: float, rounds: int) -> bool:
        return len(self.watch.commits_after(since)) >= rounds or self._over()

    def _over(self) -> bool:
        return self.watch.job.get("state") in ("finished", "failed", "cancelled")

    def _live(self) -> list[str]:
        return sorted({d for st in self.watch.plan_devices() for d in st} - self.gone)

    def _inject(self, event: Event) -> EventRecord:
        """Inject `event`; a backend that fails to is recorded (the run goes on), not raised."""
        rec = EventRecord(event)
        try:
            self._do(event, rec)
        except Exception as exc:
            rec.note = f"injection failed: {type(exc).__name__}: {exc}"
            self.log(f"event #{event.index}: {rec.note}")
        rec.injection_done = time.time()
        return rec

    def _do(self, event: Event, rec: EventRecord) -> None:
        live = self._live()
        b = self.backend
        rec.injected = time.time()
        kind = event.kind
        if kind in ("kill", "second_kill", "stop_cont", "cut_restore", "drain"):
            if not live:
                raise RuntimeError("no live device in the plan")
            target = live[event.pick % len(live)]
            rec.targets = [target]
            if kind in ("kill", "second_kill"):
                b.kill(target)
                self.gone.add(target)
            elif kind == "drain":
                b.drain(target)
                self.gone.add(target)
            else:
                stop_cont = kind == "stop_cont"
                (b.stop if stop_cont else b.cut_link)(target)
                time.sleep(event.hold_s)
                (b.cont if stop_cont else b.restore_link)(target)
        elif kind == "kill_stage":
            rec.targets, rec.note = self._stage_with_backup(event.pick)
            for target in rec.targets:
                b.kill(target)
            self.gone.update(rec.targets)
        elif kind == "join":
            rec.targets = [event.new_device]
            b.join(event.new_device)
        elif kind == "coordinator_restart":
            b.kill_coordinator()
            b.start_coordinator(resume=True)
        elif kind == "redis_restart":
            b.kill_redis()
            time.sleep(REDIS_DOWN_S)
            b.start_redis()

    def _stage_with_backup(self, pick: int) -> tuple[list[str], str]:
        """The devices of a stage and of its backup that `kill_stage` may kill, and a note.

        The schedule counts a `kill_stage` as `REMOVING["kill_stage"]` devices, so
        only a stage that loses no more than that with its backup is taken (from
        the picked one on, in plan order): a multi-device stage with its backup can
        be larger, and killing it could leave fewer devices than the job needs.
        When none fits, the picked stage's first devices up to the bound die, and
        the note says so.
        """
        stages = self.watch.plan_devices()
        bound = REMOVING["kill_stage"]
        candidates = []
        for i in range(len(stages)):
            s = (pick + i) % len(stages)
            backup = self.watch.backup(s)
            candidates.append(sorted(set(stages[s]) | ({backup} if backup else set())))
        for targets in candidates:
            if len(targets) <= bound:
                return targets, ""
        picked = candidates[0][:bound]
        return picked, f"no stage with its backup within {bound} devices: killed {picked}"

    def _second(self, first: EventRecord, event: Event) -> EventRecord:
        """Inject `event` once `first` is seen recovering (before it recovered, if in time)."""
        t0 = first.injected or time.time()
        self._until(
            f"event #{first.event.index} to be detected",
            DETECT_TIMEOUT_S,
            lambda: self.watch.first_event(t0, lambda e: e["event"] == "recovering") is not None,
        )
        rec = self._inject(event)
        done = self.watch.first_event(t0, lambda e: e["event"] in ("recovered", "replanned"))
        if done is not None:
            rec.note = "the first failure had already recovered"
        self.log(f"injected {event.describe()} on {rec.targets} during recovery")
        return rec

    def _matches(self, rec: EventRecord) -> Callable[[dict[str, Any]], bool]:
        names = set(rec.targets)

        def test(e: dict[str, Any]) -> bool:
            if e["event"] not in ("recovered", "replanned"):
                return False
            touched = set(e.get("lost", [])) | set(e.get("joined", [])) | set(e.get("left", []))
            return bool(names & touched)

        return test

    def _settle(self, rec: EventRecord) -> None:
        """Wait until the job is back from `rec`'s event and fill in its times."""
        if rec.injected is None or (not rec.targets and rec.event.kind in REPLANNING):
            return
        t0, t1 = rec.injected, rec.injection_done or rec.injected
        watch = self.watch

        def back() -> bool:
            if self._over():
                return True
            detected = watch.first_event(t0, lambda e: e["event"] == "recovering")
            done = watch.first_event(t0, self._matches(rec))
            replan = rec.event.kind in REPLANNING or (
                rec.event.kind in ("stop_cont", "cut_restore") and detected is not None
            )
            if replan and done is None:
                return False
            after = watch.commits_after(max(t1, done or t1))
            if not after:
                return False
            rec.detected, rec.recovered, rec.first_commit = detected, done, after[0]
            found = watch.find(t0, self._matches(rec)) if done else None
            rec.recovery = dict(found or {})
            return True

        what = f"the job to be back from event #{rec.event.index}"
        if not self._until(what, self.settle_timeout_s, back):
            rec.note = rec.note or "not back in time"
