"""Training goes on when a device leaves: recovery time and throughput on the edge testbed.

    python -m tests.bench.bench_recovery [--out DIR] [--quick] [--rounds N]   (root;
        make bench-recovery)
    python -m tests.bench.bench_recovery --out DIR --replot   (outputs again from DIR)

The shape of Asteroid §5.5 (Figs. 16-17). On the emulated Env D testbed (one
TX2-like and three Nano-like devices, 100 Mbit/s links, cgroup CPU quotas and
memory limits, `services.testbed`), a job trains with Asteroid's plan; once
`--fail-after` rounds are committed, one device is powered off (every process
of it SIGKILLed, `Testbed.kill`) in the middle of the next round. Each device
is dropped in turn, separately, once with lightweight recovery (partition
points moved by capacity) and once with heavy recovery (the full planner on
the survivors); then a fresh job runs on the survivors alone with the same
planner, the throughput a recovered job should come close to.

Reported per run, from the job's events and metrics streams (Redis stream ids
are commit times): detection time (kill -> the job `recovering`), re-plan and
migration time (the `recovered` event's seconds), rounds replayed, time from
the kill to the first round committed after it, and the median samples/s
before the failure, after the recovery and of the fresh plan. Per device, the
summary gives heavy/lightweight recovery time (the paper: lightweight >= 14x
faster) and lightweight throughput over the fresh plan's (the paper: >= 90%).
Outputs: DIR/recovery.md, DIR/recovery.csv, DIR/recovery.png (samples/s over
time, failures marked, like Fig. 17) and DIR/recovery.json (every measurement,
for --replot). `--quick` (a few minutes) trains small_cnn and drops one
Nano-like device.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

from common.errors import AsteroidError
from common.job import JobSpec
from common.lifecycle import TERMINAL
from common.messages import SubmitJob
from common.store import Store
from services.cli.client import ask_coordinator
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec, preset

MODELS = {
    # model: (spec, global batch, micro-batch)
    "mobilenet_v2": ({"name": "mobilenet_v2", "options": {"width_mult": 0.5}}, 32, 8),
    "small_cnn": ({"name": "small_cnn"}, 32, 8),
}
MODES = ("lightweight", "heavy")
SUBNET = "10.78.0.0/24"
"""Not bench-edge's default subnet, so both benches may run on one machine."""
CHECKPOINT_EVERY = 2
"""The failure lands one round after a checkpoint: one committed round is replayed."""
JOB_TIMEOUT_S = 600.0
REJOIN_TIMEOUT_S = 300.0
"""A restarted worker imports torch under a Nano-like quota of a fifth of a core."""


@dataclass
class Run:
    """One job: a device dropped with one recovery mode, or the survivors' fresh plan."""

    device: str
    mode: str  # lightweight, heavy or fresh
    job_id: str
    state: str = "failed"
    note: str = ""
    t_submit: float = 0.0
    """Wall time of the submission, then of the job's first `running` (the plot's origin)."""
    t_kill: float | None = None
    detect_s: float | None = None
    recover_s: float | None = None
    replayed: int | None = None
    failed_round: int | None = None
    replan_s: float | None = None
    migrate_s: float | None = None
    source: str = ""
    """Where the stages resumed from: "replicas" (survivors and backup nodes) or "checkpoint"."""
    moved_layers: int | None = None
    moved_bytes: int | None = None
    worker_s: float | None = None
    """Seconds the slowest survivor took from its recovery Assign to its Assigned."""
    worker_parts: str = ""
    """That device and where its seconds went (its "stage assigned" log line)."""
    first_commit_s: float | None = None
    before: float | None = None
    after: float | None = None
    stages_before: str = ""
    stages_after: str = ""
    series: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since submission, samples/s) per committed round."""


def _stream(store: Store, name: str, jid: str) -> list[tuple[float, dict[str, Any]]]:
    """Entries of a job's stream with their Redis ids' time (the time they were written)."""
    raw = cast(list[tuple[bytes, dict[bytes, bytes]]], store.r.xrange(store.key(name, jid)))
    return [
        (
            int(eid.split(b"-")[0]) / 1000.0,
            {k.decode(): json.loads(v) for k, v in fields.items()},
        )
        for eid, fields in raw
    ]


def _stages(stages: list[Any]) -> str:
    """A plan's stages as "a-b:dev+dev / ..." (layers a to b), from a plan or an event."""
    out = []
    for st in stages:
        if isinstance(st, dict):
            lo, hi, devs = st["start"], st["end"], [a["device"] for a in st["devices"]]
        else:
            lo, hi, devs = st
        out.append(f"{lo}-{hi}:{'+'.join(devs)}")
    return " / ".join(out)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def job_for(model: str, jid: str, rounds: int, workers: int, recovery: str) -> JobSpec:
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
            "checkpoint_every": CHECKPOINT_EVERY,
            "recovery": recovery,
            # the final evaluation is not what is measured: keep it to one batch
            "dataset": {"kind": "synthetic", "eval_size": batch},
        }
    )


def run_job(
    bed: Testbed, store: Store, job: JobSpec, victim: str | None, fail_after: int
) -> tuple[str, str, float | None]:
    """Submit `job`; with `victim`, kill it mid-round once `fail_after` rounds are committed.

    Returns the end state, the error (if any) and the wall time of the kill.
    """
    reply = ask_coordinator(bed.coordinator, SubmitJob(job=job, replace=True), timeout_s=60)
    if not reply.ok:
        return "failed", reply.error, None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    t_kill = None
    while time.monotonic() < deadline:
        fields = store.get_fields("job", job.job_id)
        state = str(fields.get("state", "?"))
        if state in TERMINAL:
            return state, "" if state == "finished" else str(fields.get("error", "")), t_kill
        if victim is not None and t_kill is None and int(fields.get("round", 0)) >= fail_after:
            rounds = [m for _, m in _stream(store, "metrics", job.job_id) if "round_s" in m]
            # into the round in flight, not at its boundary
            time.sleep(0.3 * float(rounds[-1]["round_s"]) if rounds else 0.0)
            t_kill = time.time()
            bed.kill(victim)
            print(f"  killed {victim} at round {fields.get('round')}", flush=True)
        time.sleep(0.05)
    return "timeout", f"not finished within {JOB_TIMEOUT_S:.0f} s", t_kill


def measure(store: Store, run: Run, skip: int) -> None:
    """Fill `run`'s times and throughputs from its job's streams."""
    events = _stream(store, "events", run.job_id)
    metrics = [(t, m) for t, m in _stream(store, "metrics", run.job_id) if "samples_per_s" in m]
    # the plot's origin: training starts (profiling and planning before it vary by run)
    submitted = next((t for t, e in events if e.get("event") == "running"), run.t_submit)
    run.t_submit = submitted
    run.series = [(t - submitted, float(m["samples_per_s"])) for t, m in metrics]
    plan = store.get_json("plan", run.job_id)
    recovered = next(((t, e) for t, e in events if e.get("event") == "recovered"), None)
    if run.t_kill is None or recovered is None:
        run.after = _median([float(m["samples_per_s"]) for _, m in metrics[skip:]])
        run.stages_after = _stages(plan["stages"]) if plan else ""
        return
    t_rec, rec = recovered
    recovering = next(
        (t for t, e in events if e.get("event") == "recovering" and t >= run.t_kill - 1), None
    )
    if recovering is not None:
        run.detect_s = recovering - run.t_kill
    run.recover_s = float(rec["seconds"])
    run.replayed = int(rec["replayed"])
    run.failed_round = int(rec["failed_round"])
    run.source = str(rec.get("source", ""))
    run.replan_s = float(rec.get("replan_s", 0.0))
    run.migrate_s = float(rec.get("migrate_s", 0.0))
    run.moved_layers = int(rec.get("moved_layers", 0))
    run.moved_bytes = int(rec.get("moved_bytes", 0))
    run.stages_after = _stages(rec["stages"])
    before = [float(m["samples_per_s"]) for t, m in metrics if t < run.t_kill]
    run.before = _median(before[1:] or before)  # the first round warms up
    after = [(t, float(m["samples_per_s"])) for t, m in metrics if t > t_rec]
    if after:
        run.first_commit_s = after[0][0] - run.t_kill
        run.after = _median([x for _, x in after])


WORKER_PARTS = ("send_s", "wait_s", "build_s", "read_s", "load_s")
"""Where a worker's recovery time goes: sending layers, waiting for its own, building
the model, reading the state, loading it into the model and optimizer."""


def worker_side(logs: Path, run: Run) -> None:
    """The slowest survivor's own seconds for its recovery assignment, from the worker logs.

    Each worker logs "stage assigned" with its timings; the first such line of
    the job after the kill is the recovery's (the victim's log has none then).
    """
    if run.t_kill is None:
        return
    slowest: tuple[float, str, dict[str, Any]] | None = None
    for path in sorted(logs.glob("*.worker.log")):
        line = _first_assignment(path, run.job_id, run.t_kill)
        if line is not None and (slowest is None or line["total_s"] > slowest[0]):
            slowest = (float(line["total_s"]), path.name.split(".")[0], line)
    if slowest is None:
        return
    run.worker_s, dev, line = slowest
    parts = " ".join(f"{k[:-2]} {float(line.get(k, 0.0)):.3f}" for k in WORKER_PARTS)
    run.worker_parts = f"{dev}: {parts}"


def _first_assignment(path: Path, job: str, after: float) -> dict[str, Any] | None:
    """The first "stage assigned" line of `job` in a worker log written after `after`."""
    for raw in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict) or line.get("event") != "stage assigned":
            continue
        if line.get("job") != job or "total_s" not in line:
            continue
        stamp = datetime.datetime.fromisoformat(str(line.get("timestamp", ""))).timestamp()
        if stamp >= after:
            return line
    return None


def drop_device(
    bed: Testbed,
    store: Store,
    model: str,
    dev: str,
    rounds: int,
    fail_after: int,
    last: bool,
) -> list[Run]:
    """Drop `dev` with each recovery mode, then train a fresh plan on the survivors.

    The device is powered on again after each, except after the `last` device's
    fresh run (nothing follows it).
    """
    runs = []
    for mode in MODES:
        jid = f"rec-{dev}-{mode}"
        job = job_for(model, jid, rounds, len(bed.devices), mode)
        run = Run(device=dev, mode=mode, job_id=jid, t_submit=time.time())
        t0 = time.monotonic()
        run.state, run.note, run.t_kill = run_job(bed, store, job, dev, fail_after)
        measure(store, run, skip=2)
        worker_side(bed.log_dir, run)
        runs.append(run)
        _say(run, time.monotonic() - t0)
        if mode != MODES[-1]:
            restart(bed, store, dev)
    jid = f"rec-{dev}-fresh"
    job = job_for(model, jid, rounds, len(bed.devices) - 1, "none")
    run = Run(device=dev, mode="fresh", job_id=jid, t_submit=time.time())
    t0 = time.monotonic()
    run.state, run.note, _ = run_job(bed, store, job, None, 0)
    measure(store, run, skip=2)
    runs.append(run)
    _say(run, time.monotonic() - t0)
    if not last:
        restart(bed, store, dev)
    return runs


def _say(run: Run, took: float) -> None:
    print(
        f"{run.device} {run.mode}: {run.state} detect {_fmt(run.detect_s, '.2f')} s, "
        f"recover {_fmt(run.recover_s, '.3f')} s (re-plan {_fmt(run.replan_s, '.3f')}, "
        f"migrate {_fmt(run.migrate_s, '.3f')}; slowest worker {_fmt(run.worker_s, '.3f')} "
        f"{run.worker_parts}), replayed {_fmt(run.replayed, 'd')}, "
        f"samples/s before {_fmt(run.before)} after {_fmt(run.after)} {run.note} "
        f"[{took:.0f} s]",
        flush=True,
    )


def restart(bed: Testbed, store: Store, dev: str) -> None:
    """Power device `dev` back on (worker and profiler) and wait until its worker heartbeats."""
    t0 = time.time()
    bed.start_worker(dev)
    start_profiler(bed, dev)
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if float(store.get_fields("device", dev).get("seen", 0.0)) > t0:
            time.sleep(2.0)  # a couple more heartbeats: the coordinator counts it alive
            return
        time.sleep(0.5)
    raise TimeoutError(f"{dev}'s restarted worker did not heartbeat within {REJOIN_TIMEOUT_S} s")


def _fmt(x: float | int | None, spec: str = ".1f") -> str:
    return "x" if x is None else format(x, spec)


def summary(runs: list[Run]) -> list[str]:
    """Per device: heavy/lightweight recovery time, lightweight after/fresh throughput."""
    lines = []
    for dev in dict.fromkeys(r.device for r in runs):
        by = {r.mode: r for r in runs if r.device == dev}
        light, heavy, fresh = by.get("lightweight"), by.get("heavy"), by.get("fresh")
        speed = (
            heavy.recover_s / light.recover_s
            if light and heavy and light.recover_s and heavy.recover_s
            else None
        )
        share = (
            light.after / fresh.after if light and fresh and light.after and fresh.after else None
        )
        vs_heavy = (
            light.after / heavy.after if light and heavy and light.after and heavy.after else None
        )
        lines.append(
            f"- {dev} lost: lightweight recovery {_fmt(speed, '.1f')}x faster than heavy "
            f"(paper: >= 14x); lightweight throughput after recovery "
            f"{'x' if share is None else f'{share:.0%}'} of the fresh plan's (paper: >= 90%; "
            f"{'x' if vs_heavy is None else f'{vs_heavy:.0%}'} of heavy recovery's)"
        )
    return lines


def header_lines(title: str, command: str, load: Sequence[float], spec: TestbedSpec) -> list[str]:
    """A testbed bench report's first lines: what was run, when, on what machine and testbed.

    `load` holds the 1-minute load averages at the start and the end: above the
    core count, other processes slow the devices beyond their quotas.
    """
    cores = len(os.sched_getaffinity(0))
    machine = f"- machine: {platform.machine()}, {cores} cores, Python {platform.python_version()}"
    if load:
        machine += f"; 1-minute load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end"
        if max(load) > cores:
            machine += (
                " (above the core count: other processes slow the devices beyond their "
                "quotas, and samples/s varies between runs)"
            )
    return [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        machine,
        f"- testbed {spec.name}: "
        + ", ".join(
            f"{d.name} {d.cpu:g} cores {d.memory_bytes >> 20} MiB {d.bandwidth_bps / 1e6:g} Mbit/s"
            for d in spec.devices
        ),
    ]


def write_markdown(
    path: Path,
    runs: list[Run],
    spec: TestbedSpec,
    model: str,
    cmd: str,
    load: list[float] | None = None,
) -> None:
    lines = [
        *header_lines("Recovery when a device leaves (Asteroid §5.5)", cmd, load or [], spec),
        f"- model {model}, planner asteroid, checkpoint every {CHECKPOINT_EVERY} rounds; "
        "a device is killed (SIGKILL of all its processes) mid-round",
        "- detect: kill -> job `recovering`; recover: re-plan + migration (the recovered "
        "event's seconds); first commit: kill -> first round committed after the recovery; "
        "samples/s: median round before the kill (first round left out), after the "
        "recovery, and of a fresh job on the survivors",
        "- worker s: the slowest survivor's own seconds from its recovery Assign to its "
        "reply (part of migrate s), and where they went: sending layers, waiting for its "
        "own, building the model, reading the state, loading it",
        "- lightweight: partition points moved by capacity, only the layers that change hands "
        "move, peer to peer, from the survivors and the lost stage's replica on its backup "
        "node (moved layers / MiB below); heavy: the planner service (on the host, from cached "
        "profiles) re-plans, every layer is gathered in Redis and every stage reloads from "
        "there; the paper's heavy rescheduling also runs the planner on the strongest "
        "surviving edge device",
        "",
        "| device lost | recovery | state | detect s | recover s | re-plan s | migrate s "
        "| worker s | replayed | from | moved layers | moved MiB | first commit s "
        "| samples/s before | samples/s after | fresh plan samples/s | after/fresh "
        "| stages after | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        fresh = next((f for f in runs if f.device == r.device and f.mode == "fresh"), None)
        ratio = r.after / fresh.after if r.after and fresh and fresh.after else None
        lines.append(
            f"| {r.device} | {r.mode} | {r.state} | {_fmt(r.detect_s, '.2f')} | "
            f"{_fmt(r.recover_s, '.3f')} | {_fmt(r.replan_s, '.3f')} | "
            f"{_fmt(r.migrate_s, '.3f')} | {_fmt(r.worker_s, '.3f')} | "
            f"{_fmt(r.replayed, 'd')} | {r.source} | "
            f"{_fmt(r.moved_layers, 'd')} | "
            f"{_fmt(None if r.moved_bytes is None else r.moved_bytes / 2**20, '.2f')} | "
            f"{_fmt(r.first_commit_s, '.1f')} | {_fmt(r.before)} | {_fmt(r.after)} | "
            f"{_fmt(fresh.after if fresh else None)} | "
            f"{'' if ratio is None or r.mode == 'fresh' else f'{ratio:.0%}'} | "
            f"{r.stages_after} | {r.note.splitlines()[0] if r.note else ''} |"
        )
    lines += ["", "## Summary", "", *summary(runs)]
    parts = [f"- {r.device} {r.mode}: {r.worker_parts}" for r in runs if r.worker_parts]
    if parts:
        lines += ["", "## Slowest survivor's recovery seconds, by part", "", *parts]
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, runs: list[Run]) -> None:
    cols = [
        "device",
        "mode",
        "job_id",
        "state",
        "detect_s",
        "recover_s",
        "replan_s",
        "migrate_s",
        "worker_s",
        "worker_parts",
        "replayed",
        "failed_round",
        "source",
        "moved_layers",
        "moved_bytes",
        "first_commit_s",
        "samples_per_s_before",
        "samples_per_s_after",
        "stages_after",
        "note",
    ]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in runs:
            w.writerow(
                [
                    r.device,
                    r.mode,
                    r.job_id,
                    r.state,
                    r.detect_s,
                    r.recover_s,
                    r.replan_s,
                    r.migrate_s,
                    r.worker_s,
                    r.worker_parts,
                    r.replayed,
                    r.failed_round,
                    r.source,
                    r.moved_layers,
                    r.moved_bytes,
                    r.first_commit_s,
                    r.before,
                    r.after,
                    r.stages_after,
                    r.note,
                ]
            )


def write_plot(path: Path, runs: list[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(r.device for r in runs))
    fig, axes = plt.subplots(
        1, len(devices), figsize=(max(6.0, 4 * len(devices)), 3.4), squeeze=False, sharey=True
    )
    colors = {"lightweight": "tab:blue", "heavy": "tab:orange"}
    for ax, dev in zip(axes[0], devices, strict=True):
        for r in runs:
            if r.device != dev:
                continue
            if r.mode == "fresh":
                if r.after:
                    ax.axhline(r.after, color="gray", ls="--", lw=1, label="fresh plan")
                continue
            kill = None if r.t_kill is None else r.t_kill - r.t_submit
            # no line across the recovery: no round was trained there
            parts = (
                [r.series]
                if kill is None
                else [
                    [p for p in r.series if p[0] < kill],
                    [p for p in r.series if p[0] >= kill],
                ]
            )
            for i, part in enumerate(p for p in parts if p):
                xs, ys = zip(*part, strict=True)
                label = r.mode if i == 0 else None
                ax.plot(xs, ys, "o-", ms=3, color=colors[r.mode], label=label)
            if r.t_kill is not None:
                kill_x = r.t_kill - r.t_submit
                ax.axvline(kill_x, color=colors[r.mode], ls=":", lw=1.2)
                if r.first_commit_s is not None:  # no round commits while it recovers
                    ax.axvspan(kill_x, kill_x + r.first_commit_s, color=colors[r.mode], alpha=0.12)
        ax.set_title(f"{dev} leaves", fontsize=9)
        ax.set_xlabel("seconds since training started")
        ax.grid(True, alpha=0.3)
    top = max([y for r in runs for _, y in r.series] + [r.after or 0.0 for r in runs] + [1.0])
    axes[0][0].set_ylim(0, 1.1 * top)  # shared by every panel
    axes[0][0].set_ylabel("samples/s per committed round")
    axes[0][-1].legend(fontsize=7)
    fig.text(
        0.5,
        0.005,
        "dotted line: the device is killed; shaded: until the first round commits again",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def keyed_services(bed: Testbed) -> None:
    """Start the testbed's services and submit jobs as the operator of its key set.

    The coordinator binds the bridge, beyond loopback, so the testbed makes a
    CURVE key set (`bed.keys`); the bench's requests go over it too.
    """
    bed.start_services()
    os.environ["ASTEROID_KEYS"] = str(bed.keys)
    bed.wait_ready()


def start_profiler(bed: Testbed, dev: str) -> None:
    """(Re)start device `dev`'s profiler service with the profiler's key set."""
    old = bed.procs.get(f"{dev}.profiler")
    if old is not None and old.poll() is None:
        old.kill()
        old.wait(timeout=10)
    keys = bed.profiler_keys()
    cmd = [sys.executable, "-m", "services.profiler.main", "--serve", "--keys", str(keys)]
    cmd += ["--coordinator", bed.coordinator, "--redis-url", bed.redis_url]
    bed.start(dev, f"{dev}.profiler", cmd, "profiler")


def _on_term(stop: threading.Event) -> None:
    """Make SIGTERM unwind like Ctrl-C, so the testbed's `down` runs on every way out."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/recovery"))
    parser.add_argument("--rounds", type=int, default=None, help="rounds per job")
    parser.add_argument("--fail-after", type=int, default=3, help="committed rounds before")
    parser.add_argument("--link", default="100mbit", help="every device's link rate")
    parser.add_argument("--devices", default="", help="comma-separated devices to drop")
    parser.add_argument(
        "--replot", action="store_true", help="only redo the outputs from DIR/recovery.json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small_cnn, one device dropped, few rounds"
    )
    args = parser.parse_args(argv)
    spec = preset("env-d", args.link).model_copy(update={"subnet": SUBNET})
    model = "small_cnn" if args.quick else "mobilenet_v2"
    if args.replot:
        saved = json.loads((args.out / "recovery.json").read_text())
        write_outputs(args.out, [Run(**r) for r in saved["runs"]], spec, saved["model"])
        return 0
    if os.geteuid() != 0:
        print(
            "bench-recovery builds network namespaces and cgroups: run it as root", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (6 if args.quick else 10)
    if args.devices:
        victims = [spec.device(d).name for d in args.devices.split(",")]
    else:
        victims = spec.names()[1:2] if args.quick else spec.names()
    stop = threading.Event()
    _on_term(stop)
    t0 = time.monotonic()
    load = [os.getloadavg()[0]]
    runs = run_all(spec, model, victims, rounds, args.fail_after, args.out / "logs", stop)
    command = "python -m tests.bench.bench_recovery " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    load.append(os.getloadavg()[0])
    saved = {"model": model, "command": command.strip(), "load": load}
    saved["runs"] = [asdict(r) for r in runs]
    (args.out / "recovery.json").write_text(json.dumps(saved))
    write_outputs(args.out, runs, spec, model)
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


def write_outputs(out: Path, runs: list[Run], spec: TestbedSpec, model: str) -> None:
    """The table, the CSV and the plot, from the runs and DIR/recovery.json (also --replot)."""
    saved = json.loads((out / "recovery.json").read_text())
    write_markdown(out / "recovery.md", runs, spec, model, saved["command"], saved.get("load"))
    write_csv(out / "recovery.csv", runs)
    write_plot(out / "recovery.png", runs)
    print((out / "recovery.md").read_text())


def run_all(
    spec: TestbedSpec,
    model: str,
    victims: list[str],
    rounds: int,
    fail_after: int,
    logs: Path,
    stop: threading.Event,
) -> list[Run]:
    """Bring the testbed up, drop each victim in turn, take everything down again."""
    t0 = time.monotonic()
    runs: list[Run] = []
    shutil.rmtree(logs, ignore_errors=True)  # joins are read from the logs: no old lines
    with Testbed(spec, logs, stop=stop) as bed:
        bed.up(services=False)
        keyed_services(bed)
        print(f"testbed up [{time.monotonic() - t0:.0f} s]", flush=True)
        store = Store(bed.redis_url, bed.cluster)
        try:
            for dev in victims:
                last = dev == victims[-1]
                try:
                    runs += drop_device(bed, store, model, dev, rounds, fail_after, last)
                except (AsteroidError, TimeoutError, OSError) as exc:
                    # keep what was measured: the table shows where the run stopped
                    print(f"{dev}: stopped: {exc}", flush=True)
                    runs.append(Run(device=dev, mode="aborted", job_id="", note=str(exc)))
                    break
        finally:
            store.close()
    return runs


if __name__ == "__main__":
    sys.exit(main())
