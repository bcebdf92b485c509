"""Training goes on when a device leaves: recovery time and throughput on the edge testbed.

    python -m tests.bench.bench_recovery [--out DIR] [--quick] [--rounds N]
        [--faults kill,sigstop] [--devices D,...] [--deadline HH:MM]   (root;
        make bench-recovery)
    python -m tests.bench.bench_recovery --out DIR --replot   (outputs again from DIR)

The shape of Asteroid §5.5 (Figs. 16-17). On the emulated Env D testbed (one
TX2-like and three Nano-like devices, 100 Mbit/s links, cgroup CPU quotas and
memory limits, `services.testbed`), a job trains with Asteroid's plan; once
`--fail-after` rounds are committed, one device is lost in the middle of the
next round. Each device is dropped in turn, separately: hung (every process
of it SIGSTOPped: silent, its sockets stay open, as a power cut or a pulled
cable looks) with lightweight recovery, let go (SIGCONT) once the job
recovered, when its old-epoch messages must change nothing, and used as it is
by the next job; then powered off (every process of it SIGKILLed,
`Testbed.kill`: its connections close at once) with lightweight recovery
(partition points moved by capacity) and with heavy recovery (the full
planner on the survivors); then a fresh job runs on the survivors alone with
the same planner, the throughput a recovered job should come close to.

Reported per run, from the job's events and metrics streams (Redis stream ids
are commit times): the fault -> first committed round split into its parts
(`recovery_parts`: detect, re-plan, migrate, gap, first round) and what
declared the loss (connection closed, heartbeats and a probe, ...), rounds
replayed, the ledger's verdict (every round exactly once), and the median
samples/s before the failure, after the recovery and of the fresh plan. Per
device, the summary gives heavy/lightweight recovery time (the paper:
lightweight >= 14x faster) and lightweight throughput over the fresh plan's
(the paper: >= 90%); per fault, the median parts, and for the silent loss
whether it stayed within heartbeat deadline + probe + one round. Outputs:
DIR/recovery.md, DIR/recovery.csv, DIR/recovery.png (samples/s over time,
failures marked, like Fig. 17) and DIR/recovery.json (every measurement and
the load average at the start and the end, for --replot). `--quick` (a few
minutes) trains small_cnn and drops one Nano-like device.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from common.errors import AsteroidError
from common.store import Store
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec, preset
from tests.bench.deadline import deadline_check
from tests.bench.recovery_faults import ledger_verdict, worker_side
from tests.bench.recovery_jobs import MODELS, after_cont, job_for, measure, run_job
from tests.bench.recovery_report import Run, header_lines, write_outputs_from

__all__ = [
    "MODELS",
    "REJOIN_TIMEOUT_S",
    "header_lines",
    "keyed_services",
    "main",
    "restart",
    "start_profiler",
]

FAULTS = ("kill", "sigstop")
KILL_MODES = ("lightweight", "heavy")
"""Recovery modes a SIGKILL is measured with; a SIGSTOP is measured with lightweight."""
SUBNET = "10.78.0.0/24"
"""Not bench-edge's default subnet, so both benches may run on one machine."""
REJOIN_TIMEOUT_S = 600.0
"""A restarted worker imports torch under a Nano-like quota of a fifth of a core (and, on a
loaded machine, less: other processes take the rest)."""


def one_run(
    bed: Testbed,
    store: Store,
    model: str,
    dev: str,
    mode: str,
    fault: str,
    rounds: int,
    fail_after: int,
) -> Run:
    """One job on the testbed: `dev` lost by `fault` and recovered by `mode`, or fresh."""
    fresh = mode == "fresh"
    jid = f"rec-{dev}-{mode}" if fault in ("kill", "") else f"rec-{dev}-{fault}-{mode}"
    workers = len(bed.devices) - (1 if fresh else 0)
    job = job_for(model, jid, rounds, workers, "none" if fresh else mode)
    run = Run(device=dev, mode=mode, job_id=jid, fault=fault, t_submit=time.time())
    t0 = time.monotonic()
    run.state, run.note, run.t_kill, run.t_cont, run.stages_before = run_job(
        bed, store, job, None if fresh else dev, fail_after, fault
    )
    measure(store, run, 2, bed.heartbeat_s)
    if run.t_kill is not None and dev not in run.stages_before:
        run.note = f"{dev} was not in the plan at the fault ({run.stages_before}): {run.note}"
    run.ledger = ledger_verdict(store, jid, rounds) if run.state == "finished" else ""
    run.after_cont = after_cont(store, run, bed.log_dir / "coordinator.log")
    worker_side(bed.log_dir, run)
    _say(run, time.monotonic() - t0)
    return run


def drop_device(
    bed: Testbed,
    store: Store,
    model: str,
    dev: str,
    rounds: int,
    fail_after: int,
    last: bool,
    faults: tuple[str, ...] = FAULTS,
) -> list[Run]:
    """Lose `dev` with each fault and recovery mode, then train a fresh plan on the survivors.

    The SIGSTOP comes first: a device let go that heartbeats again trains in
    the next job as it is (a hang that came back must be usable again); any
    other lost device is powered on again (restarted) before the next job,
    except before the fresh plan and after the `last` device's.
    """
    runs = []
    plan = [("sigstop", "lightweight")] if "sigstop" in faults else []
    plan += [("kill", m) for m in KILL_MODES if "kill" in faults]
    up = True
    for fault, mode in plan:
        if not up:
            restart(bed, store, dev)
        run = one_run(bed, store, model, dev, mode, fault, rounds, fail_after)
        runs.append(run)
        up = fault == "sigstop" and came_back(bed, store, run)
        if not up:
            bed.kill(dev)
    bed.kill(dev)
    runs.append(one_run(bed, store, model, dev, "fresh", "", rounds, 0))
    if not last:
        restart(bed, store, dev)
    return runs


def came_back(bed: Testbed, store: Store, run: Run) -> bool:
    """Whether a device let go after a SIGSTOP runs and heartbeats again (give it a few s)."""
    proc = bed.procs.get(f"{run.device}.worker")
    if run.t_cont is None or proc is None or proc.poll() is not None:
        return False
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if float(store.get_fields("device", run.device).get("seen", 0.0)) > run.t_cont:
            return True
        time.sleep(0.5)
    return False


def _say(run: Run, took: float) -> None:
    print(
        f"{dev_label(run)}: {run.state} [{run.signal or '-'}] {run.parts().named()} "
        f"(slowest worker {fmt_opt(run.worker_s)} {run.worker_parts}), replayed "
        f"{run.replayed}, samples/s before {fmt_opt(run.before)} after {fmt_opt(run.after)}, "
        f"ledger {run.ledger or '-'} {run.after_cont} {run.note} [{took:.0f} s]",
        flush=True,
    )


def dev_label(run: Run) -> str:
    return f"{run.device} {run.fault or 'no fault'} {run.mode}"


def fmt_opt(x: float | None) -> str:
    return "x" if x is None else f"{x:.2f}"


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


def keyed_services(bed: Testbed, ready_timeout_s: float = 300.0) -> None:
    """Start the testbed's services and submit jobs as the operator of its key set.

    The coordinator binds the bridge, beyond loopback, so the testbed makes a
    CURVE key set (`bed.keys`); the bench's requests go over it too.
    """
    bed.start_services()
    os.environ["ASTEROID_KEYS"] = str(bed.keys)
    bed.wait_ready(ready_timeout_s)


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
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="model trained")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help="comma-separated: kill, sigstop (default both)"
    )
    parser.add_argument(
        "--deadline", default="", help="HH:MM (UTC): start no further device after it"
    )
    parser.add_argument(
        "--replot", action="store_true", help="only redo the outputs from DIR/recovery.json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small_cnn, one device dropped, few rounds"
    )
    args = parser.parse_args(argv)
    spec = preset("env-d", args.link).model_copy(update={"subnet": SUBNET})
    if args.replot:
        print(write_outputs(args.out, json.loads((args.out / "recovery.json").read_text()), spec))
        return 0
    faults = tuple(f for f in args.faults.split(",") if f)
    if not faults or set(faults) - set(FAULTS):
        parser.error(f"--faults: a comma-separated list of {', '.join(FAULTS)}")
    if os.geteuid() != 0:
        print(
            "bench-recovery builds network namespaces and cgroups: run it as root", file=sys.stderr
        )
        return 2
    model = args.model or ("small_cnn" if args.quick else "mobilenet_v2")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (6 if args.quick else 10)
    if args.devices:
        victims = [spec.device(d).name for d in args.devices.split(",")]
    else:
        victims = spec.names()[1:2] if args.quick else spec.names()
    stop = threading.Event()
    _on_term(stop)
    t0 = time.monotonic()
    command = "python -m tests.bench.bench_recovery " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    saved: dict[str, Any] = {"model": model, "command": command.strip()}
    saved["load"] = [os.getloadavg()[0]]

    def keep(runs: list[Run]) -> None:
        """Save what was measured so far: a run cut short still has its outputs."""
        saved["load"] = [saved["load"][0], os.getloadavg()[0]]
        saved["runs"] = [asdict(r) for r in runs]
        (args.out / "recovery.json").write_text(json.dumps(saved))

    setup = Setup(model, rounds, args.fail_after, faults, deadline_check(args.deadline))
    runs = run_all(spec, setup, victims, args.out / "logs", stop, keep)
    keep(runs)
    print(write_outputs(args.out, saved, spec))
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


def write_outputs(out: Path, saved: dict[str, Any], spec: TestbedSpec) -> str:
    """The table, the CSV and the plot from a recovery.json's contents (also --replot)."""
    runs = [Run(**r) for r in saved["runs"]]
    for r in runs:  # saved before the fault was recorded: every loss was a SIGKILL
        if not r.fault and r.t_kill is not None:
            r.fault = "kill"
    return write_outputs_from(out, runs, spec, saved["model"], saved["command"], saved.get("load"))


@dataclass(frozen=True)
class Setup:
    """What every job of a run trains, and how its devices are lost."""

    model: str
    rounds: int
    fail_after: int
    faults: tuple[str, ...]
    past_deadline: Callable[[], bool]


def run_all(
    spec: TestbedSpec,
    setup: Setup,
    victims: list[str],
    logs: Path,
    stop: threading.Event,
    keep: Callable[[list[Run]], None],
) -> list[Run]:
    """Bring the testbed up, drop each victim in turn, take everything down again."""
    t0 = time.monotonic()
    runs: list[Run] = []
    shutil.rmtree(logs, ignore_errors=True)  # joins are read from the logs: no old lines
    with Testbed(spec, logs, stop=stop) as bed:
        bed.up(services=False)
        keyed_services(bed, REJOIN_TIMEOUT_S)
        print(f"testbed up [{time.monotonic() - t0:.0f} s]", flush=True)
        store = Store(bed.redis_url, bed.cluster)
        try:
            for dev in victims:
                if setup.past_deadline():
                    note = "not run: past --deadline"
                    runs.append(Run(device=dev, mode="skipped", job_id="", note=note))
                    continue
                last = dev == victims[-1]
                try:
                    runs += drop_device(
                        bed,
                        store,
                        setup.model,
                        dev,
                        setup.rounds,
                        setup.fail_after,
                        last,
                        setup.faults,
                    )
                except (AsteroidError, TimeoutError, OSError) as exc:
                    # keep what was measured: the table shows where the run stopped
                    print(f"{dev}: stopped: {exc}", flush=True)
                    runs.append(Run(device=dev, mode="aborted", job_id="", note=str(exc)))
                    break
                finally:
                    keep(runs)
        finally:
            store.close()
    return runs


if __name__ == "__main__":
    sys.exit(main())
