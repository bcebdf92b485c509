"""A device throttled mid-job: the coordinator re-partitions from measured speeds.

    python -m tests.bench.bench_adapt [--out DIR] [--quick] [--rounds N] [--cut-at R]
        [--device D]   (root; make bench-adapt)
    python -m tests.bench.bench_adapt --out DIR --replot   (outputs again from DIR)

FTPipeHD §III-D on the emulated Env D testbed (`services.testbed`, as
bench-recovery): every committed round reports each stage's compute time, the
coordinator turns them into measured speeds and, when they drift from the
plan's and the predicted gain pays for the migration, moves the partition
points (`services.coordinator.adapt`). Three jobs of the same length, planned
by the planner from the devices' profiles:

- undisturbed: nothing changes; it must never re-plan (no flapping on noise);
- throttled: once `--cut-at` rounds are committed, one device's CPU quota is
  cut to a third (`Testbed.slow`, a thermal throttle) while the job runs: it
  should re-plan within a few rounds and come back close to a fresh plan;
- fresh: the throttled device is restarted at its new quota (so its profile is
  measured again under it) and a new job is planned for the new speeds: the
  throughput the throttled job should come back to (the issue: within 10 %).

The device cut is one whose stage holds it alone (its stage slows down by the
whole cut, nobody shares the work), the fastest such one (`pick_device`) unless
`--device` names one. Outputs: DIR/adapt.md (table), DIR/adapt.csv,
DIR/adapt.png (samples/s over time, the cut and the re-plan marked) and
DIR/adapt.json (every measurement, for --replot). `--quick` trains small_cnn
for fewer rounds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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
from typing import Any

from common.errors import AsteroidError
from common.job import JobSpec
from common.lifecycle import TERMINAL
from common.messages import SubmitJob
from common.store import Store
from services.cli.client import ask_coordinator
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec, preset
from tests.bench.bench_recovery import header_lines, keyed_services, restart
from tests.bench.recovery_jobs import planned_job, stages_text, stream

SUBNET = "10.79.0.0/24"
"""Neither bench-edge's nor bench-recovery's subnet, so the benches may share a machine."""
CUT = 1 / 3
"""The throttled device keeps this share of its CPU quota (the issue's "cut to a third")."""
JOB_TIMEOUT_S = 1200.0
"""A job includes planning; the fresh one profiles the throttled device under its new quota."""
SKIP = 1
"""Rounds left out at the start of each measured span: the first warms up (or straddles)."""
LABELS = ("undisturbed", "throttled", "fresh")


@dataclass
class Run:
    """One job and what its events and metrics streams say about it."""

    label: str  # undisturbed, throttled or fresh
    job_id: str
    state: str = "failed"
    note: str = ""
    device: str = ""
    """The device cut (throttled) or already cut from the start (fresh)."""
    cpu: float | None = None
    """That device's quota in cores during the run (after the cut, for the throttled run)."""
    t_start: float = 0.0
    """Wall time of the job's first `running` (the plot's origin)."""
    t_cut: float | None = None
    cut_round: int | None = None
    """Rounds committed when the quota was cut (the next one was in flight)."""
    replans: int = 0
    """`replanned` events of kind adapt."""
    t_replan: float | None = None
    """When the first of them was written (the new plan runs from then on)."""
    replan_round: int | None = None
    replan_s: float | None = None
    moved_layers: int | None = None
    moved_bytes: int | None = None
    reason: str = ""
    before: float | None = None
    cut: float | None = None
    """Median samples/s between the cut and the re-plan."""
    after: float | None = None
    """Median samples/s after the re-plan (throttled), or over the run (the others)."""
    stages_before: str = ""
    stages_after: str = ""
    series: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since training started, samples/s) per committed round."""

    @property
    def rounds_to_replan(self) -> int | None:
        """Rounds trained at the cut quota on the old plan (the one in flight included)."""
        if self.replan_round is None or self.cut_round is None:
            return None
        return self.replan_round - self.cut_round


def pick_device(stages: Sequence[dict[str, Any]], cpu: dict[str, float]) -> str:
    """The device to throttle: alone in its stage if one is, and of those the one with most cores.

    Alone, so its stage slows by the whole cut; the fastest, so the cut takes the
    most compute away and the old partition points are the most wrong. A plan
    whose stages are all shared gives its fastest device.
    """
    alone = [str(st["devices"][0]["device"]) for st in stages if len(st["devices"]) == 1]
    pool = alone or [str(a["device"]) for st in stages for a in st["devices"]] or list(cpu)
    return max(pool, key=lambda d: (cpu.get(d, 0.0), -pool.index(d)))


def _median(xs: Sequence[float], skip: int = 0) -> float | None:
    """The median of `xs` without the first `skip` (all of them when that leaves none)."""
    kept = list(xs[skip:]) or list(xs)
    return statistics.median(kept) if kept else None


def job_for(model: str, jid: str, rounds: int, workers: int) -> JobSpec:
    """A planner-made job that may adapt (re-partition from measured speeds)."""
    return planned_job(model, jid, rounds, workers, adapt=True)


@dataclass(frozen=True)
class Cut:
    """Cut `device`'s quota (chosen from the running plan when empty) once `at` rounds commit."""

    at: int
    device: str = ""


def run_job(bed: Testbed, store: Store, job: JobSpec, run: Run, cut: Cut | None) -> None:
    """Submit `job` and wait for its end; with `cut`, throttle a device on the way."""
    reply = ask_coordinator(bed.coordinator, SubmitJob(job=job, replace=True), timeout_s=60)
    if not reply.ok:
        run.note = reply.error
        return
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        fields = store.get_fields("job", job.job_id)
        state = str(fields.get("state", "?"))
        if state in TERMINAL:
            run.state = state
            run.note = "" if state == "finished" else str(fields.get("error", ""))
            return
        committed = int(fields.get("round", 0))
        if cut is not None and run.t_cut is None and committed >= cut.at:
            throttle(bed, store, run, cut, committed)
        time.sleep(0.05)
    run.state, run.note = "timeout", f"not finished within {JOB_TIMEOUT_S:.0f} s"


def throttle(bed: Testbed, store: Store, run: Run, cut: Cut, committed: int) -> None:
    """Cut a device's quota to `CUT` of its own now, remembering the plan it cut into."""
    plan = store.get_json("plan", run.job_id)
    stages = plan["stages"] if plan else []
    cpus = {d.name: d.cpu for d in bed.spec.devices}
    run.device = cut.device or pick_device(stages, cpus)
    run.cpu = cpus[run.device] * CUT
    run.stages_before = stages_text(stages)
    run.t_cut, run.cut_round = time.time(), committed
    bed.slow(run.device, run.cpu)
    print(f"  {run.device}: {cpus[run.device]:g} -> {run.cpu:.3f} cores at round {committed}")


def measure(store: Store, run: Run) -> None:
    """Fill `run`'s re-plans and throughputs from its job's streams."""
    events = stream(store, "events", run.job_id)
    metrics = [
        (t, float(m["samples_per_s"]))
        for t, m in stream(store, "metrics", run.job_id)
        if "samples_per_s" in m
    ]
    run.t_start = next((t for t, e in events if e.get("event") == "running"), run.t_start)
    run.series = [(t - run.t_start, x) for t, x in metrics]
    adapted = [
        (t, e) for t, e in events if e.get("event") == "replanned" and e.get("kind") == "adapt"
    ]
    run.replans = len(adapted)
    plan = store.get_json("plan", run.job_id)
    run.stages_after = stages_text(plan["stages"]) if plan else ""
    run.stages_before = run.stages_before or run.stages_after
    if adapted:
        run.t_replan, first = adapted[0]
        run.replan_round = int(first["from_round"])
        run.replan_s = float(first["seconds"])
        run.moved_layers = int(first.get("moved_layers", 0))
        run.moved_bytes = int(first.get("moved_bytes", 0))
        run.reason = str(first.get("reason", ""))
        run.stages_after = stages_text(first["stages"])
    _throughputs(run, metrics)


def _throughputs(run: Run, metrics: Sequence[tuple[float, float]]) -> None:
    """Median samples/s before the cut, between the cut and the re-plan, and after it."""
    if run.t_cut is None:
        run.after = _median([x for _, x in metrics], 2 * SKIP)
        return
    cut, replan = run.t_cut, run.t_replan
    run.before = _median([x for t, x in metrics if t < cut], SKIP)
    if replan is None:  # never re-planned: what the cut left
        run.cut = _median([x for t, x in metrics if t >= cut], SKIP)
        return
    run.cut = _median([x for t, x in metrics if cut <= t < replan], SKIP)
    run.after = _median([x for t, x in metrics if t >= replan], SKIP)


def run_all(
    spec: TestbedSpec, model: str, rounds: int, cut: Cut, logs: Path, stop: threading.Event
) -> list[Run]:
    """Bring the testbed up, run the three jobs in turn, take everything down again."""
    t0 = time.monotonic()
    runs: list[Run] = []
    shutil.rmtree(logs, ignore_errors=True)
    with Testbed(spec, logs, stop=stop) as bed:
        bed.up(services=False)
        keyed_services(bed)
        print(f"testbed up [{time.monotonic() - t0:.0f} s]", flush=True)
        store = Store(bed.redis_url, bed.cluster)
        try:
            one(bed, store, model, rounds, Run("undisturbed", "adapt-undisturbed"), None, runs)
            throttled = Run("throttled", "adapt-throttled")
            one(bed, store, model, rounds, throttled, cut, runs)
            if throttled.device:
                fresh_at_cut(bed, store, model, rounds, throttled, runs)
        except (AsteroidError, TimeoutError, OSError) as exc:
            # keep what was measured: the table shows where the bench stopped
            print(f"stopped: {exc}", flush=True)
            runs.append(Run("aborted", "", note=str(exc)))
        finally:
            store.close()
    return runs


def one(
    bed: Testbed,
    store: Store,
    model: str,
    rounds: int,
    run: Run,
    cut: Cut | None,
    runs: list[Run],
) -> None:
    """Run one job to its end, measure it, say how it went and add it to `runs`."""
    t0 = time.monotonic()
    run.t_start = time.time()
    run_job(bed, store, job_for(model, run.job_id, rounds, len(bed.devices)), run, cut)
    measure(store, run)
    runs.append(run)
    print(
        f"{run.label}: {run.state} re-plans {run.replans} (after {_fmt(run.rounds_to_replan, 'd')}"
        f" rounds, {_fmt(run.replan_s, '.2f')} s), samples/s before {_fmt(run.before)} cut "
        f"{_fmt(run.cut)} after {_fmt(run.after)} {run.note} [{time.monotonic() - t0:.0f} s]",
        flush=True,
    )


def fresh_at_cut(
    bed: Testbed, store: Store, model: str, rounds: int, throttled: Run, runs: list[Run]
) -> None:
    """Plan a new job for the new speeds: the throttled device restarted at its cut quota.

    Its worker names its hardware (quota included) once, at start, and profiles
    are stored per such name: restarting it makes the planner see it as it now is.
    """
    bed.kill(throttled.device)
    restart(bed, store, throttled.device)
    fresh = Run("fresh", "adapt-fresh", device=throttled.device, cpu=throttled.cpu)
    one(bed, store, model, rounds, fresh, None, runs)


def _fmt(x: float | int | None, spec: str = ".1f") -> str:
    return "x" if x is None else format(x, spec)


def _pct(num: float | None, den: float | None) -> str:
    return "x" if num is None or not den else f"{num / den:.0%}"


def verdicts(runs: Sequence[Run]) -> list[str]:
    """The issue's two checks, in words."""
    by = {r.label: r for r in runs}
    throttled, fresh, calm = by.get("throttled"), by.get("fresh"), by.get("undisturbed")
    lines = []
    if throttled is not None:
        share = _pct(throttled.after, fresh.after if fresh else None)
        lines.append(
            f"- throttled: {throttled.replans} re-plan(s), the first "
            f"{_fmt(throttled.rounds_to_replan, 'd')} rounds after the cut; throughput after "
            f"it {share} of the fresh plan's (target: >= 90%)"
        )
        if throttled.reason:
            lines.append(f"- why: {throttled.reason}")
    if calm is not None:
        lines.append(f"- undisturbed: {calm.replans} re-plan(s) (target: 0)")
    return lines


def write_markdown(
    path: Path, runs: Sequence[Run], spec: TestbedSpec, model: str, saved: dict[str, Any]
) -> None:
    """The table, with what was run and on what machine above it."""
    lines = [
        *header_lines(
            "Re-partitioning from measured speeds (FTPipeHD §III-D)",
            saved["command"],
            saved.get("load") or [],
            spec,
        ),
        f"- model {model}, planner asteroid, {saved.get('rounds', '?')} rounds per job; the "
        f"throttled device's quota is cut to a third once {saved.get('cut_at', '?')} rounds "
        "are committed",
        "- samples/s: medians per committed round (the first of each span left out): before "
        "the cut, from the cut to the re-plan, after the re-plan (the undisturbed and fresh "
        "jobs: over the run, the first two left out); rounds to re-plan: rounds committed on "
        "the old plan from the cut on (the one in flight included); re-plan s: the replanned "
        "event's seconds (re-plan and migration)",
        "",
        "| run | state | device | cores | cut at round | re-plans | rounds to re-plan "
        "| re-plan s | moved layers | moved MiB | samples/s before cut | after cut "
        "| after re-plan | fresh plan | after/fresh | stages before | stages after | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fresh = next((r.after for r in runs if r.label == "fresh"), None)
    for r in runs:
        moved = None if r.moved_bytes is None else r.moved_bytes / 2**20
        lines.append(
            f"| {r.label} | {r.state} | {r.device} | {_fmt(r.cpu, '.3f')} | "
            f"{_fmt(r.cut_round, 'd')} | {r.replans} | {_fmt(r.rounds_to_replan, 'd')} | "
            f"{_fmt(r.replan_s, '.2f')} | {_fmt(r.moved_layers, 'd')} | {_fmt(moved, '.2f')} | "
            f"{_fmt(r.before)} | {_fmt(r.cut)} | {_fmt(r.after)} | {_fmt(fresh)} | "
            f"{_pct(r.after, fresh) if r.label == 'throttled' else ''} | {r.stages_before} | "
            f"{r.stages_after} | {r.note.splitlines()[0] if r.note else ''} |"
        )
    lines += ["", "## Verdict", "", *verdicts(runs)]
    path.write_text("\n".join(lines) + "\n")


CSV_COLUMNS = (
    "label",
    "job_id",
    "state",
    "device",
    "cpu",
    "cut_round",
    "replans",
    "replan_round",
    "replan_s",
    "moved_layers",
    "moved_bytes",
    "before",
    "cut",
    "after",
    "stages_before",
    "stages_after",
    "reason",
    "note",
)


def write_csv(path: Path, runs: Sequence[Run]) -> None:
    """One row per run, the columns named after `Run`'s fields."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in runs:
            row = asdict(r)
            w.writerow([row[c] for c in CSV_COLUMNS])


def write_plot(path: Path, runs: Sequence[Run]) -> None:
    """Samples/s over time: the throttled job, its cut and re-plan marked; the others as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    styles = {
        "throttled": ("o-", "tab:blue"),
        "fresh": ("-", "tab:green"),
        "undisturbed": ("-", "tab:gray"),
    }
    for r in runs:
        if r.label not in styles or not r.series:
            continue
        fmt, color = styles[r.label]
        xs, ys = zip(*r.series, strict=True)
        name = f"fresh plan ({r.device} cut)" if r.label == "fresh" else r.label
        ax.plot(xs, ys, fmt, ms=3, lw=1.2, color=color, label=name)
        if r.t_cut is not None:
            ax.axvline(r.t_cut - r.t_start, color="tab:red", ls=":", lw=1.2, label="quota cut")
        if r.t_replan is not None:
            end = r.t_replan - r.t_start
            ax.axvspan(end - (r.replan_s or 0.0), end, color="tab:orange", alpha=0.25)
            ax.axvline(end, color="tab:orange", ls="--", lw=1.2, label="re-planned")
    top = max([y for r in runs for _, y in r.series] + [1.0])
    ax.set_ylim(0, 1.1 * top)
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("samples/s per committed round")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, runs: Sequence[Run], spec: TestbedSpec, model: str) -> None:
    """The table, the CSV and the plot, from the runs and DIR/adapt.json (also --replot)."""
    saved = json.loads((out / "adapt.json").read_text())
    write_markdown(out / "adapt.md", runs, spec, model, saved)
    write_csv(out / "adapt.csv", runs)
    write_plot(out / "adapt.png", runs)
    print((out / "adapt.md").read_text())


def _on_term(stop: threading.Event) -> None:
    """Make SIGTERM unwind like Ctrl-C, so the testbed's `down` runs on every way out."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def save(
    out: Path,
    bench: str,
    argv: list[str] | None,
    load: list[float],
    fields: dict[str, Any],
    runs: Sequence[Any],
) -> None:
    """Write DIR/<bench>.json: the runs, the command and load, and `fields` (for --replot)."""
    command = f"python -m tests.bench.bench_{bench} " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    saved = {"command": command.strip(), "load": load, **fields}
    saved["runs"] = [asdict(r) for r in runs]
    (out / f"{bench}.json").write_text(json.dumps(saved))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/adapt"))
    parser.add_argument("--rounds", type=int, default=None, help="rounds per job")
    parser.add_argument("--cut-at", type=int, default=10, help="committed rounds before the cut")
    parser.add_argument("--device", default="", help="the device to throttle (default: picked)")
    parser.add_argument("--link", default="100mbit", help="every device's link rate")
    parser.add_argument("--replot", action="store_true", help="only redo the outputs")
    parser.add_argument("--quick", action="store_true", help="small_cnn, fewer rounds")
    args = parser.parse_args(argv)
    spec = preset("env-d", args.link).model_copy(update={"subnet": SUBNET})
    if args.replot:
        saved = json.loads((args.out / "adapt.json").read_text())
        write_outputs(args.out, [Run(**r) for r in saved["runs"]], spec, saved["model"])
        return 0
    if os.geteuid() != 0:
        print("bench-adapt builds network namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    model = "small_cnn" if args.quick else "mobilenet_v2"
    rounds = args.rounds or (25 if args.quick else 40)
    device = spec.device(args.device).name if args.device else ""
    args.out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    _on_term(stop)
    t0, load = time.monotonic(), [os.getloadavg()[0]]
    runs = run_all(spec, model, rounds, Cut(args.cut_at, device), args.out / "logs", stop)
    load.append(os.getloadavg()[0])
    fields = {"model": model, "rounds": rounds, "cut_at": args.cut_at}
    save(args.out, "adapt", argv, load, fields, runs)
    write_outputs(args.out, runs, spec, model)
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
