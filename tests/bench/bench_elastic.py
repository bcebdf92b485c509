"""A device joins or is drained mid-job: throughput afterwards against a fresh plan.

    python -m tests.bench.bench_elastic [--out DIR] [--quick] [--rounds N] [--at R]
        [--device D]   (root; make bench-elastic)
    python -m tests.bench.bench_elastic --out DIR --replot   (outputs again from DIR)

On the emulated Env D testbed (`services.testbed`, as bench-adapt), four jobs of
the same length, planned by the planner from the devices' profiles:

- fresh4: planned from the start on all four devices;
- drain: the same four, `DrainDevice` for `--device` (what `asteroid drain`
  sends) once `--at` rounds are committed; the coordinator moves its work to
  the others at the next round boundary. No round may be replayed: every round
  appears once in the metrics stream and the job never goes `recovering`;
- fresh3: planned from the start on the three others;
- join: the three others start the job; once `--at` rounds are committed the
  fourth device comes up and the coordinator takes it in at a round boundary
  (a `replanned` event of kind join).

The joining device's worker is a new process, started before the job and frozen
(its cgroup) until the coordinator counts it dead; it is thawed at round `--at`.
A worker started cold then would spend tens of seconds importing torch under its
Nano-like quota, and the join would land that many rounds later. Re-planning from measured
speeds (`adapt`) is off in every job: only the join or the drain re-plans.

Outputs: DIR/elastic.md (table), DIR/elastic.csv, DIR/elastic.png (samples/s per
committed round, the join/drain and the re-plan marked) and DIR/elastic.json
(every measurement, for --replot). `--quick` trains small_cnn.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.errors import AsteroidError
from common.ids import DeviceId
from common.messages import DrainDevice
from common.settings import CoordinatorSettings
from common.store import Store
from services.cli.client import ask_coordinator
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec, preset
from tests.bench.bench_adapt import (
    SKIP,
    _fmt,
    _on_term,
    _pct,
    _throughputs,
    job_for,
    run_job,
    save,
)
from tests.bench.bench_adapt import Run as AdaptRun
from tests.bench.bench_recovery import header_lines, keyed_services, restart, start_profiler
from tests.bench.recovery_jobs import stages_text, stream

SUBNET = "10.80.0.0/24"
"""Neither bench-adapt's, bench-recovery's nor bench-edge's subnet: they may share a machine."""
LABELS = ("join", "fresh4", "drain", "fresh3")
FRESH = {"join": "fresh4", "drain": "fresh3"}
"""Each elastic run and the fresh plan its throughput afterwards is held against."""
DRAIN_REPLY_S = 15.0


@dataclass
class Run(AdaptRun):
    """One job; bench-adapt's fields, the cut being the join or drain request.

    `t_cut`/`cut_round`: when (and after how many committed rounds) the device
    was thawed or the drain asked for; `cut`: median samples/s from then to the
    re-plan; `replans`: `replanned` events of this run's kind.
    """

    committed: int = 0
    """Distinct rounds in the metrics stream."""
    replayed: int | None = None
    """Rounds committed more than once (metrics stream), or the event's count if higher."""
    recoverings: int = 0
    """`recovering` events: a join or drain must never look like a loss."""
    by_round: list[tuple[int, float]] = field(default_factory=list)
    """(rounds committed, samples/s) per committed round."""


def act_at(store: Store, run: Run, at: int, act: Callable[[int], None]) -> threading.Event:
    """Call `act(committed)` once `at` rounds of `run`'s job are committed, in a thread.

    Setting the returned event stops the watch (the job ended first). A failing
    act is noted on the run, not raised: the job goes on and is measured.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            committed = int(store.get_fields("job", run.job_id).get("round", 0))
            if committed < at:
                continue
            plan = store.get_json("plan", run.job_id)
            run.stages_before = stages_text(plan["stages"]) if plan else ""
            run.t_cut, run.cut_round = time.time(), committed
            try:
                act(committed)
            except (AsteroidError, OSError) as exc:
                run.note = f"{run.label} at round {committed} failed: {exc}"
            return

    threading.Thread(target=watch, name=f"{run.label}-at-{at}", daemon=True).start()
    return done


def one(
    bed: Testbed,
    store: Store,
    job: tuple[str, int, int],
    run: Run,
    act: tuple[int, Callable[[int], None]] | None = None,
) -> Run:
    """Run one job (model, rounds, workers) to its end, `act` on the way; measure it."""
    model, rounds, workers = job
    t0 = time.monotonic()
    run.t_start = time.time()
    spec = job_for(model, run.job_id, rounds, workers).model_copy(update={"adapt": False})
    done = None if act is None else act_at(store, run, act[0], act[1])
    try:
        run_job(bed, store, spec, run, None)
    finally:
        if done is not None:
            done.set()
    measure(store, run)
    print(
        f"{run.label}: {run.state} re-planned at round {_fmt(run.replan_round, 'd')} "
        f"({_fmt(run.replan_s, '.2f')} s), samples/s before {_fmt(run.before)} after "
        f"{_fmt(run.after)}, rounds {run.committed} replayed {_fmt(run.replayed, 'd')} "
        f"recovering {run.recoverings} {run.note} [{time.monotonic() - t0:.0f} s]",
        flush=True,
    )
    return run


def measure(store: Store, run: Run) -> None:
    """Fill `run`'s re-plan, rounds and throughputs from its job's streams."""
    events = stream(store, "events", run.job_id)
    metrics = [(t, m) for t, m in stream(store, "metrics", run.job_id) if "samples_per_s" in m]
    run.t_start = next((t for t, e in events if e.get("event") == "running"), run.t_start)
    rates = [(t, float(m["samples_per_s"])) for t, m in metrics]
    run.series = [(t - run.t_start, x) for t, x in rates]
    rounds = [int(m["round"]) for _, m in metrics]
    run.by_round = [(r + 1, x) for r, (_, x) in zip(rounds, rates, strict=True)]
    run.committed = len(set(rounds))
    run.replayed = len(rounds) - run.committed
    run.recoverings = sum(1 for _, e in events if e.get("event") == "recovering")
    plan = store.get_json("plan", run.job_id)
    run.stages_after = stages_text(plan["stages"]) if plan else ""
    run.stages_before = run.stages_before or run.stages_after
    replanned = [
        (t, e) for t, e in events if e.get("event") == "replanned" and e.get("kind") == run.label
    ]
    run.replans = len(replanned)
    if replanned:
        run.t_replan, first = replanned[0]
        run.replan_round = int(first["from_round"])
        run.replan_s = float(first["seconds"])
        run.moved_layers = int(first.get("moved_layers", 0))
        run.moved_bytes = int(first.get("moved_bytes", 0))
        run.reason = str(first.get("reason", ""))
        run.stages_after = stages_text(first["stages"])
        run.replayed = max(run.replayed, int(first.get("replayed", 0)))
    _throughputs(run, rates)


def set_aside(bed: Testbed, store: Store, dev: str) -> None:
    """Give `dev` a new worker, freeze the device and wait until the coordinator counts it dead.

    A new process: the coordinator takes in only a worker that never held a
    stage (state idle), and this one served the drain. Frozen, not killed:
    thawed, it heartbeats again at once and is taken into the running job.
    """
    bed.kill(dev)
    restart(bed, store, dev)
    bed.pause(dev)
    misses = CoordinatorSettings.model_fields["heartbeat_misses"].default
    time.sleep(2 * bed.heartbeat_s * misses)


def join(bed: Testbed, dev: str) -> Callable[[int], None]:
    """Thaw `dev`: its worker heartbeats again (started again if it had exited)."""

    def act(committed: int) -> None:
        bed.resume(dev)
        worker = bed.procs.get(f"{dev}.worker")
        if worker is None or worker.poll() is not None:
            bed.start_worker(dev)
            start_profiler(bed, dev)
        print(f"  {dev} thawed at round {committed}", flush=True)

    return act


def drain(bed: Testbed, dev: str) -> Callable[[int], None]:
    """Ask the coordinator to drain `dev`, as `asteroid drain DEV` does."""

    def act(committed: int) -> None:
        reply = ask_coordinator(bed.coordinator, DrainDevice(target=DeviceId(dev)), DRAIN_REPLY_S)
        if not reply.ok:
            raise AsteroidError(f"drain refused: {reply.error}")
        print(f"  drain of {dev} asked at round {committed}", flush=True)

    return act


def run_all(
    spec: TestbedSpec, model: str, rounds: int, at: int, dev: str, logs: Path, stop: threading.Event
) -> list[Run]:
    """Bring the testbed up, run the four jobs, take everything down again.

    Order: fresh4 and drain with every device; then `dev` leaves for fresh3
    and the join, where it comes back.
    """
    t0 = time.monotonic()
    runs: list[Run] = []
    every = len(spec.devices)
    shutil.rmtree(logs, ignore_errors=True)
    with Testbed(spec, logs, stop=stop) as bed:
        bed.up(services=False)
        keyed_services(bed)
        print(f"testbed up [{time.monotonic() - t0:.0f} s]", flush=True)
        store = Store(bed.redis_url, bed.cluster)
        try:
            runs.append(one(bed, store, (model, rounds, every), Run("fresh4", "elastic-fresh4")))
            run = Run("drain", "elastic-drain", device=dev)
            runs.append(one(bed, store, (model, rounds, every), run, (at, drain(bed, dev))))
            set_aside(bed, store, dev)
            run = Run("fresh3", "elastic-fresh3", device=dev)
            runs.append(one(bed, store, (model, rounds, every - 1), run))
            run = Run("join", "elastic-join", device=dev)
            runs.append(one(bed, store, (model, rounds, every - 1), run, (at, join(bed, dev))))
        except (AsteroidError, TimeoutError, OSError) as exc:
            # keep what was measured: the table shows where the bench stopped
            print(f"stopped: {exc}", flush=True)
            runs.append(Run("aborted", "", note=str(exc)))
        finally:
            store.close()
    return sorted(runs, key=lambda r: LABELS.index(r.label) if r.label in LABELS else 99)


def verdicts(runs: Sequence[Run]) -> list[str]:
    """The issue's checks, in words."""
    by = {r.label: r for r in runs}
    lines = []
    for label, base in FRESH.items():
        run, fresh = by.get(label), by.get(base)
        if run is None:
            continue
        lines.append(
            f"- {label} of {run.device}: {run.replans} re-plan(s), at round "
            f"{_fmt(run.replan_round, 'd')} (asked at {_fmt(run.cut_round, 'd')}); throughput "
            f"after it {_pct(run.after, fresh.after if fresh else None)} of {base}'s "
            f"(target: within 10%); rounds replayed {_fmt(run.replayed, 'd')}, recovering "
            f"events {run.recoverings} (target: 0, 0)"
        )
    return lines


def write_markdown(
    path: Path, runs: Sequence[Run], spec: TestbedSpec, model: str, saved: dict[str, Any]
) -> None:
    """The table, with what was run and on what machine above it."""
    lines = [
        *header_lines(
            "A device joins or is drained mid-job, against fresh plans",
            saved["command"],
            saved.get("load") or [],
            spec,
        ),
        f"- model {model}, planner asteroid (adapt off), {saved.get('rounds', '?')} rounds per "
        f"job; the device joins (thawed) or is drained once {saved.get('at', '?')} rounds are "
        "committed",
        "- samples/s: medians per committed round: before the request (the first round left "
        "out), from the request to the re-plan, after the re-plan (its first round left "
        "out); fresh plans: over the run, the first two left out. Replayed: rounds committed "
        "more than once; re-plan s: the replanned event's seconds (re-plan and migration); "
        "device: the one that joins or is drained (fresh3: the one left out)",
        "",
        "| run | state | device | asked at round | re-planned at round | plan before "
        "| plan after | samples/s before | until re-plan | after re-plan | fresh plan "
        "| after/fresh | rounds | replayed | recovering | re-plan s | moved layers "
        "| moved MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    after = {r.label: r.after for r in runs}
    for r in runs:
        fresh = after.get(FRESH.get(r.label, r.label))
        moved = None if r.moved_bytes is None else r.moved_bytes / 2**20
        lines.append(
            f"| {r.label} | {r.state} | {r.device} | {_fmt(r.cut_round, 'd')} | "
            f"{_fmt(r.replan_round, 'd')} | {r.stages_before} | {r.stages_after} | "
            f"{_fmt(r.before)} | {_fmt(r.cut)} | {_fmt(r.after)} | {_fmt(fresh)} | "
            f"{_pct(r.after, fresh) if r.label in FRESH else ''} | {r.committed} | "
            f"{_fmt(r.replayed, 'd')} | {r.recoverings} | {_fmt(r.replan_s, '.2f')} | "
            f"{_fmt(r.moved_layers, 'd')} | {_fmt(moved, '.3f')} | "
            f"{r.note.splitlines()[0] if r.note else ''} |"
        )
    lines += ["", "## Verdict", "", *verdicts(runs)]
    path.write_text("\n".join(lines) + "\n")


CSV_COLUMNS = (
    "label",
    "job_id",
    "state",
    "device",
    "cut_round",
    "replans",
    "replan_round",
    "replan_s",
    "moved_layers",
    "moved_bytes",
    "before",
    "cut",
    "after",
    "committed",
    "replayed",
    "recoverings",
    "stages_before",
    "stages_after",
    "reason",
    "note",
)
"""`Run` fields, one column each (`cut_round`: the round the join or drain was asked at)."""


def write_csv(path: Path, runs: Sequence[Run]) -> None:
    """One row per run."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in runs:
            row = asdict(r)
            w.writerow([row[c] for c in CSV_COLUMNS])


STYLES = {
    "join": ("o-", "tab:blue"),
    "fresh4": ("-", "tab:green"),
    "drain": ("s-", "tab:red"),
    "fresh3": ("-", "tab:green"),
}


def write_plot(path: Path, runs: Sequence[Run]) -> None:
    """Samples/s per committed round: join beside fresh4, drain beside fresh3.

    The round the change was asked at (dotted) and the round the new plan ran
    from (dashed) are marked on each elastic run's panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r.label: r for r in runs}
    fig, axes = plt.subplots(1, len(FRESH), figsize=(10, 3.6), sharey=True, squeeze=False)
    for ax, (label, base) in zip(axes[0], FRESH.items(), strict=True):
        for r in (by.get(label), by.get(base)):
            if r is None or not r.by_round:
                continue
            fmt, color = STYLES[r.label]
            xs, ys = zip(*r.by_round, strict=True)
            ax.plot(xs, ys, fmt, ms=3, lw=1.2, color=color, label=r.label)
            if r.cut_round is not None:
                ax.axvline(r.cut_round, color="gray", ls=":", lw=1.2, label=f"{label} asked")
            if r.replan_round is not None:
                ax.axvline(r.replan_round, color="gray", ls="--", lw=1.2, label="re-planned")
        ax.set_title(f"{label} of {by[label].device}" if label in by else label, fontsize=9)
        ax.set_xlabel("rounds committed")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    top = max([y for r in runs for _, y in r.by_round] + [1.0])
    axes[0][0].set_ylim(0, 1.1 * top)
    axes[0][0].set_ylabel("samples/s per committed round")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, runs: Sequence[Run], spec: TestbedSpec, model: str) -> None:
    """The table, the CSV and the plot, from the runs and DIR/elastic.json (also --replot)."""
    saved = json.loads((out / "elastic.json").read_text())
    write_markdown(out / "elastic.md", runs, spec, model, saved)
    write_csv(out / "elastic.csv", runs)
    write_plot(out / "elastic.png", runs)
    print((out / "elastic.md").read_text())


def load_runs(saved: dict[str, Any]) -> list[Run]:
    """The runs of an elastic.json (JSON made the tuples lists)."""
    runs = []
    for raw in saved["runs"]:
        run = Run(**raw)
        run.series = [(float(t), float(x)) for t, x in run.series]
        run.by_round = [(int(n), float(x)) for n, x in run.by_round]
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/elastic"))
    parser.add_argument("--rounds", type=int, default=None, help="rounds per job")
    parser.add_argument("--at", type=int, default=10, help="committed rounds before the change")
    parser.add_argument("--device", default="", help="the device to join/drain (default: last)")
    parser.add_argument("--link", default="100mbit", help="every device's link rate")
    parser.add_argument("--replot", action="store_true", help="only redo the outputs")
    parser.add_argument("--quick", action="store_true", help="small_cnn instead of mobilenet_v2")
    args = parser.parse_args(argv)
    spec = preset("env-d", args.link).model_copy(update={"subnet": SUBNET})
    if args.replot:
        saved = json.loads((args.out / "elastic.json").read_text())
        write_outputs(args.out, load_runs(saved), spec, saved["model"])
        return 0
    if os.geteuid() != 0:
        print(
            "bench-elastic builds network namespaces and cgroups: run it as root", file=sys.stderr
        )
        return 2
    model = "small_cnn" if args.quick else "mobilenet_v2"
    rounds = args.rounds or 40
    if rounds <= args.at + 2 * SKIP + 1:
        parser.error(f"--rounds {rounds}: too few to measure after round --at {args.at}")
    device = spec.device(args.device).name if args.device else spec.names()[-1]
    args.out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    _on_term(stop)
    t0, load = time.monotonic(), [os.getloadavg()[0]]
    runs = run_all(spec, model, rounds, args.at, device, args.out / "logs", stop)
    load.append(os.getloadavg()[0])
    save(args.out, "elastic", argv, load, {"model": model, "rounds": rounds, "at": args.at}, runs)
    write_outputs(args.out, runs, spec, model)
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
