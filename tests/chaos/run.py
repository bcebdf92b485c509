"""Run a seeded chaos run and write its report: `python -m tests.chaos.run`.

    python -m tests.chaos.run --backend loopback --seed 7 --events 6 --out DIR

One job (small_cnn; a finite synthetic data set of several epochs; Adam with a
warm-up and cosine schedule; checkpoints every 2 rounds and replicas every
round) is planned by the planner, so a joining device can be taken in, while
the schedule's events are injected; then the invariants are checked and the
report written to --out. Exit code 0 when every invariant holds, 1 otherwise.

Why Adam at lr 1e-5 can be held to 1e-6 of single-process training: the
distributed run sums the same gradients in another order (micro-batches,
stage boundaries, a group's all-reduce, a replayed round after a rollback),
which changes them by float32 round-off (~1e-7 relative). SGD scales that
difference by the learning rate; Adam divides by sqrt(v), so a weight whose
gradient is near zero can see its whole step change: one step moves a weight by
at most about lr, and with lr 1e-5 even that stays within the tolerance over
the few dozen rounds of the short run, while a larger rate (1e-3) would not
(`tests.integration.test_equivalence_configs` uses the same rate for Adam).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.checkpoint import load_full_state
from common.store import Store
from tests.chaos import invariants
from tests.chaos.backend import KINDS, Backend, Kind
from tests.chaos.invariants import Check, GrowthRule
from tests.chaos.report import write
from tests.chaos.runner import SETTLE_TIMEOUT_S, START_TIMEOUT_S, Runner, RunResult
from tests.chaos.schedule import Schedule, draw
from tests.reference import reference_train

MODEL = {"name": "small_cnn"}
SEED = 5
BATCH = 32
MICRO = 8
ROUNDS_PER_EPOCH = 6
EPOCH_SAMPLES = BATCH * ROUNDS_PER_EPOCH
OPTIMIZER: dict[str, Any] = {
    "kind": "adam",
    "lr": 1e-5,
    "weight_decay": 1e-4,
    "schedule": {"kind": "cosine", "warmup_rounds": 2, "min_lr": 1e-6},
}
JOB_ID = "chaos"
LEFTOVER_WAIT_S = 30.0


def job_for(
    schedule: Schedule, devices: int, per_event: int = 10, jid: str = JOB_ID
) -> dict[str, Any]:
    """The run's job: long enough for every event, a whole number of epochs."""
    needed = schedule.rounds_needed(per_event)
    rounds = ROUNDS_PER_EPOCH * math.ceil(needed / ROUNDS_PER_EPOCH)
    return {
        "job_id": jid,
        "model": MODEL,
        "seed": SEED,
        "rounds": rounds,
        "global_batch": BATCH,
        "micro_batch": MICRO,
        "optimizer": OPTIMIZER,
        "dataset": {"kind": "synthetic", "train_size": EPOCH_SAMPLES, "eval_size": BATCH},
        "checkpoint_every": 2,
        "replicate_every": 1,
        "min_workers": devices,
        "adapt": False,  # on a loaded machine speeds jump: only the events may re-plan
    }


@dataclass
class Outcome:
    result: RunResult
    checks: list[Check]
    report: Path

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and not self.result.problems

    def failures(self) -> str:
        bad = [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]
        return "\n".join(bad + self.result.problems)


def _leftovers(backend: Backend, devices: set[str], timeout_s: float) -> list[str]:
    """Device processes still running `timeout_s` after the coordinator exited."""
    end = time.monotonic() + timeout_s
    while True:
        left = [n for n in backend.pids() if n.partition("@")[0] in devices]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.2)


def work_starts(result: RunResult) -> dict[str, list[float]]:
    """When processes that came during the run went to work: the growth check's baselines.

    A joined device's processes from the first round committed with it; a
    restarted coordinator from its first committed round (`invariants.growth`).
    """
    out: dict[str, list[float]] = {}
    for rec in result.records:
        if rec.first_commit is None:
            continue
        if rec.event.kind == "join":
            for device in rec.targets:
                out.setdefault(device, []).append(rec.first_commit)
        elif rec.event.kind == "coordinator_restart":
            out.setdefault("coordinator", []).append(rec.first_commit)
    return out


def chaos_run(
    make_backend: Callable[[int], Backend],
    seed: int,
    events: int,
    *,
    devices: list[str],
    need: int,
    kinds: Sequence[Kind] | None = None,
    deadline: float,
    rule: GrowthRule | None = None,
    timeouts: tuple[float, float] = (START_TIMEOUT_S, SETTLE_TIMEOUT_S),
    per_event: int = 10,
    log: Callable[[str], None] = print,
) -> Outcome:
    """Draw the schedule, run it, check the invariants, write the report.

    `make_backend(spares)` makes the backend, with `spares` devices ready to
    join (named `j1`, `j2`, ... as the schedule names joiners). `timeouts`: the
    runner's waits for the first commit and for the job to be back from an event.
    `per_event`: rounds the job gets per event beyond its gap (`Schedule.rounds_needed`).
    The single-process reference trains on a thread meanwhile (torch computes
    outside the GIL), so the run's end does not wait for it.
    """
    wanted = [k for k in (kinds or KINDS) if k in make_backend(0).supports]
    schedule = draw(seed, events, wanted, initial_devices=len(devices), need=need)
    joins = sum(1 for e in schedule.events if e.kind == "join")
    backend = make_backend(joins)
    job = job_for(schedule, len(devices), per_event)
    rounds = int(job["rounds"])
    pool = ThreadPoolExecutor(1, thread_name_prefix="chaos-reference")
    reference = pool.submit(
        reference_train, MODEL, SEED, BATCH, rounds, OPTIMIZER, dataset=job["dataset"]
    )
    pool.shutdown(wait=False)
    log(f"schedule (seed {seed}): {[e.kind for e in schedule.events]}; {rounds} rounds")
    start_s, settle_s = timeouts
    runner = Runner(
        backend,
        schedule,
        job,
        None,
        devices,
        deadline=deadline,
        start_timeout_s=start_s,
        settle_timeout_s=settle_s,
        log=log,
    )
    try:
        result = runner.run()
    except BaseException:
        backend.close()  # a testbed leaves namespaces and cgroups behind otherwise
        raise
    joined = {e.new_device for e in schedule.events if e.kind == "join"}
    left = _leftovers(backend, set(devices) | joined, min(LEFTOVER_WAIT_S, runner.left(60)))
    store = Store(backend.redis_url, backend.cluster)
    try:
        state = store.get_fields("job", JOB_ID).get("state")
        ledger = store.read("ledger", JOB_ID)
        try:
            final = load_full_state(store, JOB_ID, rounds)
        except Exception as exc:  # the weights check reports it
            log(f"no final checkpoint: {exc}")
            final = None
    finally:
        store.close()
        result.problems += backend.close()
    ref, _ = reference.result(timeout=max(60.0, deadline - time.time()))
    last_commit = max((t for t, _ in result.commits), default=result.ended)
    checks = [
        invariants.finished(result.exit_code, state),
        invariants.ledger(ledger, rounds, EPOCH_SAMPLES),
        invariants.weights(final, ref),
        invariants.growth(
            result.samples, result.warm, rule, until=last_commit, work_starts=work_starts(result)
        ),
        Check(
            "every device process exited at the end",
            not left,
            f"still running: {left}" if left else "none left",
        ),
        Check(
            "every event injected and recovered from",
            len(result.records) == events and all(r.first_commit for r in result.records),
            f"{sum(1 for r in result.records if r.first_commit)} of {events}",
        ),
    ]
    report = write(result, checks, backend.out, backend.name)
    return Outcome(result, checks, report)


def _backend(name: str, out: Path) -> Callable[[int], Backend]:
    if name == "loopback":
        from tests.chaos.loopback import LoopbackBackend

        cluster = f"chaos-{int(time.time())}"
        return lambda spares: LoopbackBackend(
            out, cluster, env={"ASTEROID_REDIS_OUTAGE_S": "90"}, spares=spares
        )
    from tests.chaos.testbed_backend import TestbedBackend

    return lambda spares: TestbedBackend(out, spares=spares)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__)
    parser.add_argument("--backend", choices=["loopback", "testbed"], default="loopback")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--devices", type=int, default=5, help="devices at the start")
    parser.add_argument("--need", type=int, default=2, help="fewest live devices to keep")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--kinds", nargs="*", choices=list(KINDS), help="event kinds to draw")
    parser.add_argument("--per-event", type=int, default=10, help="job rounds per event")
    args = parser.parse_args(argv)
    testbed = args.backend == "testbed"
    if testbed and os.geteuid() != 0:
        print("the testbed backend builds network namespaces: run it as root", file=sys.stderr)
        return 2
    make_backend = _backend(args.backend, args.out)
    names = [chr(ord("a") + i) for i in range(args.devices)]
    outcome = chaos_run(
        make_backend,
        args.seed,
        args.events,
        devices=names,
        need=args.need,
        kinds=args.kinds,
        deadline=time.time() + args.timeout,
        # devices with a CPU quota on a loaded machine profile, plan and import slowly
        timeouts=(400.0, 180.0) if testbed else (START_TIMEOUT_S, SETTLE_TIMEOUT_S),
        per_event=args.per_event,
    )
    print(outcome.report.read_text())
    if not outcome.ok:
        print(outcome.failures(), file=sys.stderr)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
