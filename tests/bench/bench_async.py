"""Asynchronous pipelining without a drain (PipeDream, FTPipeHD) against synchronous.

    python -m tests.bench.bench_async [--out DIR] [--reps N] [--heavy-reps N]
        [--rounds N] [--hetero-rounds N] [--acc-rounds N] [--lr-reference] [--quick]
        [--deadline HH:MM]   (root)

Four emulated devices of the env-d preset (`services.testbed.spec`: a TX2-like
device at 0.5 cores and three Nano-like ones at 0.177; network namespaces,
1 Gbit/s shaped links, cgroup CPU quotas and memory limits). Each run is a
coordinator of its own on the host side and fresh workers inside the devices;
Redis runs on the testbed's bridge. Same seed and optimizer (plain SGD at one
learning rate) in every compared mode.

Part 1, throughput at the same plan (`async_jobs.STAGE_DEVICES`: one layer of
`fl_cnn` per stage, the heaviest on the fastest device), sync and async at the
same micro-batch, in two sets of rows: light layers (`fl_cnn` on 8x8 digits,
sub-millisecond layers whose per-micro-batch update is not small against them)
at 4, 16 and 64 micro-batches per window, `--reps` times; heavy layers
(`async_jobs.HEAVY_MODEL`: the same net at CIFAR's 3x32x32, a conv layer's
compute large against its parameters, PipeDream's and FTPipeHD's regime; the
same plan, `HEAVY_STAGE_DEVICES`) at 4 and 16, `--heavy-reps` times; each set
interleaved. Samples/s is the global batch over the median round of the
coordinator's round metrics, the first round skipped. Beside the measured
async/sync ratio: the ratio
`services.planner.async_gain` predicts from the same runs' stage timings, and
sync's predicted bubble.

Then a balanced set (`async_jobs.BALANCED_MODEL`: mobilenet_v2 at half width on 3x32x32,
20 layers cut so that each stage takes about as long on its device, by the host's
profile over each device's quota) at 4 and 16, `--heavy-reps` times: sync's bubble is
then fill and drain rather than one slow stage, PipeDream's and FTPipeHD's setting.

Part 2, a heterogeneous pipeline with the dynamic partition on (`async_hetero`):
sync, then async, on a plan balanced for the devices' speeds, the device with
the most layers throttled to a third mid-run; samples/s before, throttled and after
the re-partition, and the re-partition events.

Part 3, held-out accuracy against wall clock over windows of 16 micro-batches:
sync, async and async with FTPipeHD's weight aggregation, `--acc-rounds`
rounds each with an evaluation every `--eval-every` rounds; with
`--lr-reference`, one more sync run at M times the learning rate is a
reference row.

Outputs: DIR/table.md, DIR/results.json, DIR/throughput.png, DIR/accuracy.png;
process logs under DIR/logs. The testbed (namespaces, links, cgroups), its
Redis and every process are removed at the end, also after an error or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.bench.async_hetero import extras_for, hetero_part, host_profile, throttle_for
from tests.bench.async_jobs import (
    ACC_WINDOW,
    BALANCED_DATA,
    BALANCED_DEVICES,
    BALANCED_MODEL,
    BALANCED_WINDOWS,
    EVAL_EVERY,
    HEAVY_DATA,
    HEAVY_MODEL,
    HEAVY_STAGE_DEVICES,
    HEAVY_WINDOWS,
    HETERO_DEVICES,
    LAYERS,
    STAGE_DEVICES,
    WINDOWS,
    accuracy_configs,
    k0,
    throughput_configs,
)
from tests.bench.async_report import save_json, write_outputs
from tests.bench.async_runners import SUBNET, testbed_runner
from tests.bench.async_runs import Run, accuracy_part, throughput_part
from tests.bench.deadline import deadline_check

__all__ = ["SUBNET", "main"]

THROTTLE_AT = 8
"""Part 2: rounds committed before the throttle (after `adapt.ADAPT_AFTER`'s baseline)."""


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the testbed's cleanup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/async"))
    parser.add_argument("--reps", type=int, default=1, help="repetitions of a light-layer run")
    parser.add_argument(
        "--heavy-reps", type=int, default=2, help="repetitions of a heavy or balanced run"
    )
    parser.add_argument("--rounds", type=int, default=8, help="rounds of a throughput run")
    parser.add_argument("--hetero-rounds", type=int, default=50, help="rounds of a part 2 run")
    parser.add_argument("--acc-rounds", type=int, default=40, help="rounds of an accuracy run")
    parser.add_argument(
        "--lr-reference", action="store_true", help="part 3 also runs sync at M x the rate"
    )
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one rep, fewer rounds, M 4 and 16, heavy and balanced M 4",
    )
    parser.add_argument("--deadline", default="", help="UTC HH:MM: start no run after it")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_async builds network namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    windows = WINDOWS[:2] if args.quick else WINDOWS
    heavy_windows = HEAVY_WINDOWS[:1] if args.quick else HEAVY_WINDOWS
    balanced_windows = BALANCED_WINDOWS[:1] if args.quick else BALANCED_WINDOWS
    if args.quick:
        args.reps, args.heavy_reps = 1, 1
        args.rounds, args.hetero_rounds, args.acc_rounds = 5, 20, 20
    command = "python -m tests.bench.bench_async " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    header: dict[str, Any] = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "rounds": args.rounds,
        "reps": args.reps,
        "heavy_reps": args.heavy_reps,
        "hetero_rounds": args.hetero_rounds,
        "acc_rounds": args.acc_rounds,
        "eval_every": args.eval_every,
        "k0": {m: k0(LAYERS, m) for m in (*windows, ACC_WINDOW)},
    }
    past = deadline_check(args.deadline)
    t0 = time.monotonic()
    runs: list[Run] = []

    def save(part: list[Run]) -> None:
        save_json(args.out, header, [*runs, *part])

    args.out.mkdir(parents=True, exist_ok=True)
    profile = host_profile()
    balanced_profile = host_profile(BALANCED_MODEL)
    with testbed_runner(args.out) as (runner, spec):
        header["testbed"] = (
            ", ".join(
                f"{d.name} ({d.kind}) {d.cpu:g} cores {d.memory_bytes >> 20} MiB"
                for d in spec.devices
            )
            + f"; links {spec.devices[0].bandwidth_bps / 1e9:g} Gbit/s"
        )
        header["plan"] = " | ".join(f"layer {i}: {d}" for i, d in enumerate(STAGE_DEVICES))
        header["heavy_plan"] = " | ".join(
            f"layer {i}: {d}" for i, d in enumerate(HEAVY_STAGE_DEVICES)
        )
        tput = throughput_configs(windows)
        runs += throughput_part(runner, STAGE_DEVICES, args.rounds, args.reps, past, save, tput)
        runs += throughput_part(
            runner,
            HEAVY_STAGE_DEVICES,
            args.rounds,
            args.heavy_reps,
            past,
            save,
            throughput_configs(heavy_windows, "heavy "),
            part="heavy",
            model=HEAVY_MODEL,
            data=HEAVY_DATA,
        )
        cpus = {d.name: d.cpu for d in spec.devices}
        memory = {d.name: d.memory_bytes for d in spec.devices}
        _, balanced = extras_for(balanced_profile, cpus, memory, None, BALANCED_DEVICES)
        header["balanced_plan"] = " | ".join(
            f"layers {balanced[i]}-{balanced[i + 1]}: {d}" for i, d in enumerate(BALANCED_DEVICES)
        )
        runs += throughput_part(
            runner,
            BALANCED_DEVICES,
            args.rounds,
            args.heavy_reps,
            past,
            save,
            throughput_configs(balanced_windows, "balanced "),
            part="balanced",
            model=BALANCED_MODEL,
            data=BALANCED_DATA,
            cuts=balanced,
        )
        extras, cuts = extras_for(profile, cpus, memory, None)
        throttle = throttle_for(cpus, cuts, THROTTLE_AT)
        extras = replace(extras, throttle=throttle)
        header["hetero_plan"] = " | ".join(
            f"layers {cuts[i]}-{cuts[i + 1]}: {d}" for i, d in enumerate(HETERO_DEVICES)
        )
        header["throttle"] = (
            f"{throttle.device} to {throttle.cpu:.3f} cores after round {throttle.at}"
        )
        runs += hetero_part(runner, extras, cuts, args.hetero_rounds, past, save)
        acc = accuracy_configs(len(STAGE_DEVICES))[: 4 if args.lr_reference else 3]
        runs += accuracy_part(
            runner, STAGE_DEVICES, args.acc_rounds, args.eval_every, past, save, acc
        )
    header["runtime_s"] = round(time.monotonic() - t0, 1)
    header["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_outputs(args.out, header, runs)
    print((args.out / "table.md").read_text())
    return 0 if runs and all(r.samples_per_s for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
