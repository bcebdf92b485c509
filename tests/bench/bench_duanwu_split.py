"""Duan & Wu's split device on real compute: the split's measured gain on one and two cores, epochs.

    python -m tests.bench.bench_duanwu_split [--out DIR] [--quick] [--rounds N] [--repeats N]
        [--gain-repeats N] [--device-cpu C] [--models M ...] [--meet] [--deadline HH:MM]
        (root; cgroup cpu, memory, freezer and cpuset controllers)

Part 1 (`tests.bench.duanwu_split_gain`): for each stage of the depth-4 plan,
a forward+backward pair in turn vs on Duan & Wu's two lanes, measured on this
machine bound to one core and to two cores, and inside each emulated device;
the planner's decision per device from each.
Part 2 (`tests.bench.duanwu_split_epoch`): epoch time of that plan on four
emulated devices with a cpuset of this machine's two cores each: plain, split
everywhere, and split where the planner's rule allows.
`--meet` adds the one-core quota experiment (`tests.bench.duanwu_split_meet`).

Outputs: DIR/table.md, DIR/results.json, DIR/gain.png, DIR/epoch.png (DIR/meet.png).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.bench.deadline import deadline_check
from tests.bench.duanwu_split_common import (
    DEVICE_CORES,
    DEVICE_CPU,
    DEVICE_MEMORY,
    DEVICES,
    EPOCH_SAMPLES,
    GLOBAL_BATCH,
    MODELS,
    PAPER_PCT_SHORTER,
)
from tests.bench.duanwu_split_epoch import (
    EpochBench,
    EpochRow,
    model_plans,
    simulator_models_split,
)
from tests.bench.duanwu_split_gain import StageGain, decide, host_gains, stage_gains
from tests.bench.duanwu_split_meet import GRID, cpu_cgroup_writable, lane_core, run_meetings
from tests.bench.duanwu_split_report import write_outputs


def header_for(command: str, cpu: float = DEVICE_CPU) -> dict[str, Any]:
    """What the results are about: command, date, machine, the devices, the paper's figures."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"load {os.getloadavg()[0]:.2f}, torch {torch.__version__}",
        "simulator_models_forward_share": simulator_models_split(),
        "epoch_samples": EPOCH_SAMPLES,
        "devices": {
            "count": DEVICES,
            "cpu": cpu,
            "cores": DEVICE_CORES,
            "memory_bytes": DEVICE_MEMORY,
        },
        "global_batch": GLOBAL_BATCH,
        "paper_fig5_pct_shorter": PAPER_PCT_SHORTER,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/duanwu-split"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per epoch run")
    parser.add_argument("--repeats", type=int, default=None, help="epoch runs per variant")
    parser.add_argument("--gain-repeats", type=int, default=None, help="pairs per gain figure")
    parser.add_argument("--device-cpu", type=float, default=DEVICE_CPU, help="quota per device")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mobilenet_v2"])
    parser.add_argument("--meet", action="store_true", help="add the one-core quota experiment")
    parser.add_argument("--reps", type=int, default=None, help="--meet repetitions per beta")
    parser.add_argument("--skip-epoch", action="store_true", help="gains on this machine only")
    parser.add_argument("--deadline", default="", help="HH:MM UTC: start no epoch run after it")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 and not args.skip_epoch:
        print("the epoch part needs root (the testbed); --skip-epoch runs without", file=sys.stderr)
        return 2
    rounds = args.rounds or (3 if args.quick else 6)
    repeats = args.repeats or (1 if args.quick else 2)
    gain_repeats = args.gain_repeats or (5 if args.quick else 11)
    command = "python -m tests.bench.bench_duanwu_split " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    header = {
        **header_for(command.strip(), args.device_cpu),
        "rounds": rounds,
        "repeats": repeats,
        "gain_repeats": gain_repeats,
    }
    t0 = time.monotonic()
    cores = sorted(os.sched_getaffinity(0))
    plans = model_plans(args.models, args.device_cpu)
    gains: list[StageGain] = []
    for model, (cost, plan) in plans.items():
        rows = stage_gains(model, plan)
        host_gains(rows, gain_repeats, cores)
        for where in ("one core", "two cores"):
            decide(cost, plan, rows, where)
        gains += rows
    meetings = []
    if args.meet and cpu_cgroup_writable():
        reps = args.reps or (3 if args.quick else 15)
        meetings = run_meetings(args.models, GRID, reps, warmup=2, core=lane_core())
    epochs: list[EpochRow] = []
    write_outputs(args.out, meetings, gains, epochs, header)
    if not args.skip_epoch:
        by_stage = {(g.model, g.device): g for g in gains}

        def written(on_device: list[StageGain], rows: list[EpochRow]) -> None:
            for g in on_device:  # the device's measurement and decision join the host's
                mine = by_stage[(g.model, g.device)]
                mine.on_device, mine.decisions["device"] = g.on_device, g.decisions["device"]
            epochs[:] = rows
            header["planner_choice"] = bench.choices
            write_outputs(args.out, meetings, gains, epochs, header)

        bench = EpochBench(args.out, rounds, cpu=args.device_cpu)
        bench.run(plans, deadline_check(args.deadline), repeats, gain_repeats, written)
    header["runtime_s"] = round(time.monotonic() - t0, 1)
    header["load_end"] = round(os.getloadavg()[0], 2)
    write_outputs(args.out, meetings, gains, epochs, header)
    print((args.out / "table.md").read_text())
    return 0 if all(r.samples_per_s for r in epochs) else 1


if __name__ == "__main__":
    sys.exit(main())
