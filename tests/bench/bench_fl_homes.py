"""Eco-FL against FedAvg, FedAsync, FedAT and Astraea with real homes on the edge testbed.

    python -m tests.bench.bench_fl_homes [--out DIR] [--quick] [--budget S] [--updates N]
        [--alphas 0.1,0.5] [--strategies ecofl,fedavg] [--wan 20mbit] [--deadline HH:MM]
        (root; make bench-fl-homes)
    python -m tests.bench.bench_fl_homes --out DIR --replot   (outputs again from DIR)

Unlike `bench_fl` (a virtual clock), every home here is a real coordinator with real
workers inside emulated devices (namespace, shaped link, CPU quota, memory limit), in
Eco-FL's regime (`fl_homes_setup`): home speeds several-fold apart, rounds of seconds,
and one home throttled half-way through every run. The federation service runs inside
a device of its own whose link (`--wan`) every home<->federation transfer crosses.
Each strategy runs for the same budget from the end of its warm-up round (every
home's cold start), or until its updates are done.
Outputs: DIR/results.md, DIR/results.json, DIR/curves.png.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.bench.deadline import deadline_check
from tests.bench.fl_homes_report import row, save, write_outputs
from tests.bench.fl_homes_setup import (
    STARTUP_CPU,
    STRATEGIES,
    TARGETS,
    RunResult,
    plan_runs,
    testbed_spec,
)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(s for s in text.split(",") if s)
    unknown = [s for s in names if s not in STRATEGIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"strategies from {', '.join(STRATEGIES)}, got {text!r}")
    return names


def _alphas(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(s) for s in text.split(",") if s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alphas are numbers, got {text!r}") from None
    if not values or any(not 0 < a <= 1000 for a in values):
        raise argparse.ArgumentTypeError(f"alphas must be in (0, 1000], got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --quick: Eco-FL and FedAvg, a short budget unless one is given."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/fl-homes"))
    parser.add_argument("--quick", action="store_true", help="ecofl and fedavg, short")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds per run on the federation's clock"
    )
    parser.add_argument("--updates", type=int, default=1000, help="global updates per run at most")
    parser.add_argument("--alphas", type=_alphas, default=(0.1,), help="Dirichlet alphas, a,b")
    parser.add_argument("--strategies", type=_names, default=STRATEGIES, help="which, a,b")
    parser.add_argument("--wan", default="20mbit", help="the federation device's link rate")
    parser.add_argument("--deadline", default="", help="UTC HH:MM: start no run after it")
    parser.add_argument("--replot", action="store_true", help="only redo the outputs")
    args = parser.parse_args(argv)
    if args.quick:
        args.strategies = tuple(s for s in args.strategies if s in ("ecofl", "fedavg"))
    if args.budget is None:
        args.budget = 25.0 if args.quick else 40.0
    if args.budget <= 0 or args.updates < 1 or not args.strategies:
        parser.error("--budget and --updates must be positive, and a strategy is needed")
    return args


def run_all(args: argparse.Namespace, header: dict[str, Any], results: list[RunResult]) -> None:
    """Bring the testbed up, run every planned run that starts before the deadline, down."""
    from common.embedded_redis import EmbeddedRedis
    from services.testbed.bed import Testbed
    from tests.bench.bench_recovery import _on_term
    from tests.bench.fl_homes_run import Bench

    stop = threading.Event()
    _on_term(stop)
    past = deadline_check(args.deadline)
    spec = testbed_spec(args.wan)
    with Testbed(spec, args.out / "logs" / "testbed", stop=stop) as bed:
        bed.up(services=False)
        with EmbeddedRedis(host=bed.bridge) as redis:
            bench = Bench(bed, redis.url, args.out, args)
            bench.make_keys()
            for i, run in enumerate(plan_runs(args.strategies, args.alphas)):
                if past():
                    r = RunResult(run.strategy, run.alpha, run.slowdown, state="skipped")
                    r.note = "not run: past the deadline"
                else:
                    print(f"{run.label}: starting", flush=True)
                    r = bench.run(run, i, stop, STARTUP_CPU)
                    c = row(r)
                    print(
                        f"{run.label}: {r.state} final {c['final']} updates {c['updates']} "
                        f"to targets {[c[f't{int(t * 100)}'] for t in TARGETS]} "
                        f"regroups {c['regroups']} ratio {c['ratio']} noise {c['noise']} "
                        f"[{r.wall_s:.0f} s]",
                        flush=True,
                    )
                results.append(r)
                save(args.out, header, results)
                if stop.is_set():
                    break


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        from tests.bench.fl_homes_report import load

        write_outputs(args.out, *load(args.out))
        return 0
    if os.geteuid() != 0:
        print("bench-fl-homes builds namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m tests.bench.bench_fl_homes " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    import platform

    header: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"load {os.getloadavg()[0]:.1f} at the start",
        "wan": args.wan,
        "budget": args.budget,
        "updates": args.updates,
    }
    results: list[RunResult] = []
    t0 = time.monotonic()
    try:
        run_all(args, header, results)
    finally:
        header["wall_s"] = round(time.monotonic() - t0)
        header["load_end"] = round(os.getloadavg()[0], 1)
        save(args.out, header, results)
        write_outputs(args.out, header, results)
    print((args.out / "results.md").read_text())
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
