"""One job of the recovery bench on the testbed: submitted, a device lost mid-round, measured.

`run_job` drives the job and injects the fault; `measure` reads what happened
from the job's streams (Redis stream ids are the times entries were written)
and splits the fault -> first commit into its parts (`recovery_parts`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from common.job import JobSpec
from common.lifecycle import TERMINAL
from common.messages import SubmitJob
from common.store import Store
from services.cli.client import ask_coordinator
from services.testbed.bed import Testbed
from tests.bench.recovery_faults import cont_pids, ignored_from, stop_device, timeouts_in_force
from tests.bench.recovery_parts import detection_signal, split
from tests.bench.recovery_report import CHECKPOINT_EVERY, Run

__all__ = [
    "JOB_TIMEOUT_S",
    "MODELS",
    "after_cont",
    "job_for",
    "measure",
    "planned_job",
    "run_job",
    "stages_text",
    "stream",
]

MODELS = {
    # model: (spec, global batch, micro-batch)
    "mobilenet_v2": ({"name": "mobilenet_v2", "options": {"width_mult": 0.5}}, 32, 8),
    "small_cnn": ({"name": "small_cnn"}, 32, 8),
}
JOB_TIMEOUT_S = 600.0


def stream(store: Store, name: str, jid: str) -> list[tuple[float, dict[str, Any]]]:
    """Entries of a job's stream with their Redis ids' time (the time they were written)."""
    raw = cast(list[tuple[bytes, dict[bytes, bytes]]], store.r.xrange(store.key(name, jid)))
    return [
        (
            int(eid.split(b"-")[0]) / 1000.0,
            {k.decode(): json.loads(v) for k, v in fields.items()},
        )
        for eid, fields in raw
    ]


def stages_text(stages: Sequence[Any]) -> str:
    """A plan's stages as "a-b:dev+dev / ..." (layers a to b), from a plan or an event."""
    out = []
    for st in stages:
        if isinstance(st, dict):
            lo, hi, devs = st["start"], st["end"], [a["device"] for a in st["devices"]]
        else:
            lo, hi, devs = st
        out.append(f"{lo}-{hi}:{'+'.join(devs)}")
    return " / ".join(out)


def planned_job(model: str, jid: str, rounds: int, workers: int, **extra: Any) -> JobSpec:
    """A planner-made job of the testbed benches (profiles, so measured speeds mean
    something); `extra` sets what a bench varies (recovery, adapt)."""
    spec, batch, micro = MODELS[model]
    return JobSpec.model_validate(
        {
            "job_id": jid,
            "model": spec,
            "global_batch": batch,
            "micro_batch": micro,
            "rounds": rounds,
            "optimizer": {"kind": "sgd", "lr": 0.01},
            "planner": "asteroid",
            "min_workers": workers,
            "seed": 1,
            # the final evaluation is not what is measured: keep it to one batch
            "dataset": {"kind": "synthetic", "eval_size": batch},
            **extra,
        }
    )


def job_for(model: str, jid: str, rounds: int, workers: int, recovery: str) -> JobSpec:
    return planned_job(
        model, jid, rounds, workers, recovery=recovery, checkpoint_every=CHECKPOINT_EVERY
    )


def _recovered_and_committed(store: Store, jid: str, after: float) -> bool:
    """Whether job `jid` recovered after wall time `after` and committed a round since."""
    recovered = [
        t for t, e in stream(store, "events", jid) if e.get("event") == "recovered" and t > after
    ]
    if not recovered:
        return False
    return any(t > recovered[0] and "samples_per_s" in m for t, m in stream(store, "metrics", jid))


def run_job(
    bed: Testbed, store: Store, job: JobSpec, victim: str | None, fail_after: int, fault: str
) -> tuple[str, str, float | None, float | None, str]:
    """Submit `job`; with `victim`, lose it mid-round once `fail_after` rounds are committed.

    `fault` "kill" SIGKILLs every process of the victim; "sigstop" stops them
    and lets them go (SIGCONT) once the job recovered and committed a round,
    or when the job ends, whichever comes first. Returns the end state, the
    error (if any), the wall time of the fault and that of the SIGCONT, and
    the plan's stages at the fault (the planner may leave a device out).
    """
    reply = ask_coordinator(bed.coordinator, SubmitJob(job=job, replace=True), timeout_s=60)
    if not reply.ok:
        return "failed", reply.error, None, None, ""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    t_kill = t_cont = None
    stopped: list[int] = []
    stages = ""
    try:
        while time.monotonic() < deadline:
            fields = store.get_fields("job", job.job_id)
            state = str(fields.get("state", "?"))
            if state in TERMINAL:
                error = "" if state == "finished" else str(fields.get("error", ""))
                return state, error, t_kill, t_cont, stages
            if victim is not None and t_kill is None and int(fields.get("round", 0)) >= fail_after:
                rounds = [m for _, m in stream(store, "metrics", job.job_id) if "round_s" in m]
                # into the round in flight, not at its boundary
                time.sleep(0.3 * float(rounds[-1]["round_s"]) if rounds else 0.0)
                plan = store.get_json("plan", job.job_id)
                stages = stages_text(plan["stages"]) if plan else ""
                t_kill = time.time()
                if fault == "sigstop":
                    stopped = stop_device(bed, victim)
                else:
                    bed.kill(victim)
                print(f"  {fault} {victim} at round {fields.get('round')}", flush=True)
            if stopped and _recovered_and_committed(store, job.job_id, t_kill or 0.0):
                t_cont = time.time()
                cont_pids(stopped)
                stopped = []
                print(f"  sigcont {victim} after {t_cont - (t_kill or t_cont):.1f} s", flush=True)
            time.sleep(0.05)
        return "timeout", f"not finished within {JOB_TIMEOUT_S:.0f} s", t_kill, t_cont, stages
    finally:
        cont_pids(stopped)  # never leave a device stopped behind


def measure(store: Store, run: Run, skip: int, heartbeat_s: float) -> None:
    """Fill `run`'s times, parts and throughputs from its job's streams."""
    events = stream(store, "events", run.job_id)
    metrics = [(t, m) for t, m in stream(store, "metrics", run.job_id) if "samples_per_s" in m]
    # the plot's origin: training starts (profiling and planning before it vary by run)
    submitted = next((t for t, e in events if e.get("event") == "running"), run.t_submit)
    run.t_submit = submitted
    run.series = [(t - submitted, float(m["samples_per_s"])) for t, m in metrics]
    plan = store.get_json("plan", run.job_id)
    t_kill = run.t_kill
    recovered = next(
        (
            (t, e)
            for t, e in events
            if e.get("event") == "recovered" and t_kill is not None and t > t_kill
        ),
        None,
    )
    if t_kill is None or recovered is None:
        run.after = statistics.median(
            [float(m["samples_per_s"]) for _, m in metrics[skip:]] or [0.0]
        )
        run.stages_after = stages_text(plan["stages"]) if plan else ""
        return
    t_rec, rec = recovered
    recovering = next(
        ((t, e) for t, e in events if e.get("event") == "recovering" and t >= t_kill - 1), None
    )
    run.reason = str((recovering[1] if recovering else rec).get("reason", ""))
    run.signal = detection_signal(run.reason)
    run.recover_s = float(rec["seconds"])
    run.replayed = int(rec["replayed"])
    run.failed_round = int(rec["failed_round"])
    run.source = str(rec.get("source", ""))
    run.moved_layers = int(rec.get("moved_layers", 0))
    run.moved_bytes = int(rec.get("moved_bytes", 0))
    run.stages_after = stages_text(rec["stages"])
    before = [(t, m) for t, m in metrics if t < t_kill]
    rates = [float(m["samples_per_s"]) for _, m in before]
    run.before = statistics.median(rates[1:] or rates) if rates else None  # round 1 warms up
    secs = [float(m["round_s"]) for _, m in before[1:] if "round_s" in m]
    run.round_s = statistics.median(secs) if secs else None
    after = [(t, float(m["samples_per_s"])) for t, m in metrics if t > t_rec]
    parts = split(
        t_kill,
        recovering[0] if recovering else None,
        t_rec,
        float(rec.get("replan_s", 0.0)),
        float(rec.get("migrate_s", 0.0)),
        after[0][0] if after else None,
    )
    run.detect_s, run.replan_s, run.migrate_s = parts.detect_s, parts.replan_s, parts.migrate_s
    run.gap_s, run.first_round_s, run.first_commit_s = (
        parts.gap_s,
        parts.first_round_s,
        parts.total_s,
    )
    if after:
        run.after = statistics.median([x for _, x in after])
    deadline, probe, run.timeouts = timeouts_in_force(store, run.job_id, heartbeat_s)
    if run.fault == "sigstop" and run.round_s is not None:
        run.bound_s = deadline + probe + run.round_s


def after_cont(store: Store, run: Run, coordinator_log: Path) -> str:
    """What a stopped device did once let go: heartbeats again, taken back in, or neither,
    and what of it the coordinator set aside (its messages of the old epoch)."""
    if run.t_cont is None:
        return "never let go during the job" if run.fault == "sigstop" else ""
    seen = float(store.get_fields("device", run.device).get("seen", 0.0))
    events = stream(store, "events", run.job_id)
    back = [
        str(e.get("event"))
        for t, e in events
        if t > run.t_cont and e.get("event") in ("replanned", "recovered", "recovering")
    ]
    end = max((t for t, _ in events), default=run.t_cont)
    ignored = ignored_from(coordinator_log, run.device, run.t_cont, end + 1.0)
    aside = "; ".join(f"{n} x {event}" for event, n in sorted(ignored.items()))
    return (
        f"let go {run.t_cont - (run.t_kill or run.t_cont):.1f} s after the stop: "
        f"{'heartbeats again' if seen > run.t_cont else 'no heartbeat since'}"
        f"{', then ' + ', '.join(back) if back else ', not taken back in'}"
        f"; the coordinator set aside: {aside or 'nothing logged'}"
    )
