"""Real training on the emulated edge testbed: Asteroid's plan against the other parallelisms.

    python -m tests.bench.bench_edge [--out DIR] [--quick] [--rounds N] [--models M ...]
        (root; make bench-edge)

For each testbed preset (Asteroid's Env C over 100 Mbps and Env D over 1 Gbps,
`services.testbed.spec`: CPU quotas in the ratio of the boards' peak
throughput, memory limits scaled from the boards'), each model (mobilenet_v2,
bert_small) and each planner (asteroid, dp, gpipe, pipedream, hetpipe), the
job runs `--rounds` real training rounds on the testbed's workers: network
namespaces with `tc`-shaped links, cgroup CPU quotas and memory limits. The
coordinator profiles each kind of device inside its namespace and cgroup (the
first job of a model), the planner service plans, workers train.

Reported per run: measured samples/s (global batch over the median round
after the first two), the simulator's samples/s for the same plan and
profiles, their ratio, each device's peak memory (cgroup high-water mark) and
Asteroid's speedup over each baseline. A plan that fails shows "x" with the
reason (e.g. a device killed by the out-of-memory killer at its limit).
Outputs: DIR/edge.md, DIR/edge.csv, DIR/edge.png.

The peers a user would pick instead run beside the planners (unless
`--no-peers`), on the same models, data, global batch and SGD, in the same
device namespaces, CPU quotas and memory limits (a testbed without services,
brought up afresh per run so each peer gets the whole limit and its own peak):
torch DDP over gloo (`torch-ddp`, the global batch split equally) and
`torch.distributed.pipelining` with Schedule1F1B (`torch-pipe`, the layers
split evenly over the devices in preset order), both `tests.bench.peers`. A
peer the kernel kills at a memory limit is marked "OOM", one that fails
otherwise "failed: <reason>"; edge.md gets a table of Asteroid against both.

`--memory-case` adds the paper's "x" marks on purpose: one Nano-like device
gets a memory limit below what GPipe's memory-unaware plan needs; GPipe's plan
fails with an out-of-memory report while Asteroid's, which knows the limit,
trains.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from common.job import JobSpec
from common.messages import SubmitJob
from common.procs import stop_all
from common.store import Store
from common.zoo import ModelSpec
from services.cli.client import ask_coordinator
from services.cli.follow import follow
from services.cli.report import job_report
from services.testbed.bed import Testbed
from services.testbed.net import NS_IFACE
from services.testbed.spec import TestbedSpec, preset

PLANNERS = ("asteroid", "dp", "gpipe", "pipedream", "hetpipe")
MODELS = {
    # model: (spec, global batch, micro-batch)
    "mobilenet_v2": ({"name": "mobilenet_v2", "options": {"width_mult": 0.5}}, 32, 8),
    "bert_small": ({"name": "bert_small"}, 16, 4),
}
PRESETS = (("env-c", "100mbit"), ("env-d", "1gbit"))
MiB = 1 << 20
# Below the 455 MiB a Nano-like worker peaked at under the memory-unaware plans
# (gpipe, pipedream, hetpipe) of mobilenet_v2 in Env D, above the ~320 MiB of
# Asteroid's and dp's: the planners see 400 - 256 (a worker's own footprint) MiB.
TIGHT_NANO = 400 * MiB
PEERS = {"torch-ddp": "ddp", "torch-pipe": "pipe"}
"""The peers' names in the tables, and their `tests.bench.peers --mode`."""
PEER_PORT = 29500
"""Rank 0's rendezvous port, in a namespace of its own: nothing else listens there."""
AIMS = {("env-c", "mobilenet_v2"): 3.0, ("env-d", "mobilenet_v2"): 1.5}
"""Asteroid's aimed speedup over torch DDP, per testbed and model."""


@dataclass
class Row:
    """One planner's job on one model and testbed."""

    testbed: str
    model: str
    planner: str
    state: str = "failed"
    stages: str = ""
    measured: float | None = None
    simulated: float | None = None
    peak_mib: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.simulated:
            return None
        return self.measured / self.simulated


def run_job(bed: Testbed, store: Store, job: JobSpec, timeout_s: float) -> Row:
    """Submit `job`, follow it, and describe what happened."""
    row = Row(testbed=bed.spec.name, model=job.model.name, planner=job.planner)
    for dev in bed.devices:
        bed.cgroup(dev).reset_peak()
    kills = {dev: bed.oom_kills(dev) for dev in bed.devices}
    reply = ask_coordinator(bed.coordinator, SubmitJob(job=job, replace=True), timeout_s=60)
    if not reply.ok:
        row.note = reply.error
        return row
    view = follow(store, job.job_id, Console(file=io.StringIO()), timeout_s=timeout_s)
    row.state = view.state
    row.peak_mib = {dev: bed.cgroup(dev).peak_memory() / MiB for dev in bed.devices}
    killed = [dev for dev in bed.devices if bed.oom_kills(dev) > kills[dev]]
    if killed:
        limits = ", ".join(
            f"{d} (limit {bed.spec.device(d).memory_bytes / MiB:.0f} MiB)" for d in killed
        )
        row.note = f"out of memory: the kernel killed the worker on {limits}"
        for dev in killed:
            bed.start_worker(dev)
    elif view.state != "finished":
        row.note = view.error
    plan = store.get_json("plan", job.job_id)
    if plan is not None:
        row.stages = " | ".join(
            "+".join(a["device"] for a in st["devices"]) for st in plan["stages"]
        )
    if view.state == "finished":
        rep = job_report(store, job.job_id)
        row.measured = rep.measured_samples_per_s
        row.simulated = rep.sim.throughput if rep.sim else None
    return row


def job_for(model: str, planner: str, rounds: int, min_workers: int) -> JobSpec:
    spec, batch, micro = MODELS[model]
    return JobSpec.model_validate(
        {
            "job_id": f"{model}-{planner}",
            "model": spec,
            "global_batch": batch,
            "micro_batch": micro,
            "rounds": rounds,
            "optimizer": {"kind": "sgd", "lr": 0.01},
            "planner": planner,
            "min_workers": min_workers,
            "seed": 1,
        }
    )


def run_testbed(spec: TestbedSpec, models: list[str], rounds: int, logs: Path) -> list[Row]:
    rows = []
    with Testbed(spec, logs / spec.name) as bed:
        bed.up()
        os.environ["ASTEROID_KEYS"] = str(bed.keys)  # jobs are submitted as its operator
        store = Store(bed.redis_url, bed.cluster)
        try:
            for model in models:
                for planner in PLANNERS:
                    job = job_for(model, planner, rounds, len(bed.devices))
                    t0 = time.monotonic()
                    row = run_job(bed, store, job, timeout_s=900)
                    print(
                        f"{spec.name} {model} {planner}: {row.state} "
                        f"{row.measured or 0:.1f} samples/s (sim {row.simulated or 0:.1f}) "
                        f"{row.note} [{time.monotonic() - t0:.0f} s]",
                        flush=True,
                    )
                    rows.append(row)
        finally:
            store.close()
    return rows


def peer_command(
    mode: str, rank: int, world: int, master: str, model: str, rounds: int, result: Path
) -> list[str]:
    """One rank of a peer, training what `job_for(model, ...)` trains."""
    raw, batch, micro = MODELS[model]
    spec = ModelSpec.model_validate(raw)
    cmd = [sys.executable, "-m", "tests.bench.peers", "--mode", mode, "--rank", str(rank)]
    cmd += ["--world", str(world), "--master", master, "--model", spec.name]
    cmd += ["--options", json.dumps(spec.options), "--rounds", str(rounds)]
    cmd += ["--global-batch", str(batch), "--micro-batch", str(micro), "--lr", "0.01"]
    cmd += ["--seed", "1", "--iface", NS_IFACE, "--result", str(result)]
    return cmd


def _last_line(bed: Testbed, name: str) -> str:
    """The last non-empty line of a process's log: the exception, when it raised."""
    lines = [ln for ln in bed.tail(name, lines=40).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def wait_peers(bed: Testbed, names: Sequence[str], timeout_s: float) -> str | None:
    """Wait for every rank to exit; why the run failed, or None.

    A rank that fails leaves the others blocked in a collective, so the rest
    are stopped at once rather than left to their own timeout.
    """
    procs = [bed.procs[n] for n in names]
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        bad = [(n, c) for n, c in zip(names, codes, strict=True) if c not in (None, 0)]
        if bad:
            stop_all(procs)
            name, code = bad[0]
            return f"{name} exited with {code}: {_last_line(bed, name)}"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            stop_all(procs)
            return f"timed out after {timeout_s:.0f} s"
        time.sleep(1.0)


def run_peer(bed: Testbed, model: str, peer: str, rounds: int, timeout_s: float) -> Row:
    """Run peer `peer` with one rank per device of `bed`, and describe what happened."""
    devs = bed.devices
    row = Row(testbed=bed.spec.name, model=model, planner=peer)
    row.stages = ("+" if PEERS[peer] == "ddp" else " | ").join(devs)
    master = f"{bed.address(devs[0])}:{PEER_PORT}"
    kills = {dev: bed.oom_kills(dev) for dev in devs}
    names, results = [], []
    for rank, dev in enumerate(devs):
        name = f"{peer}-{model}.{dev}"
        result = bed.log_dir / f"{name}.json"
        cmd = peer_command(PEERS[peer], rank, len(devs), master, model, rounds, result)
        bed.start(dev, name, cmd)
        names.append(name)
        results.append(result)
    failure = wait_peers(bed, names, timeout_s)
    row.peak_mib = {dev: bed.peak_memory(dev) / MiB for dev in devs}
    killed = [dev for dev in devs if bed.oom_kills(dev) > kills[dev]]
    if killed:
        limits = ", ".join(
            f"{d} (limit {bed.spec.device(d).memory_bytes / MiB:.0f} MiB)" for d in killed
        )
        row.note = f"OOM: the kernel killed the peer on {limits}"
    elif failure is not None:
        row.note = f"failed: {failure}"
    else:
        # Ranks time the same rounds between barriers; the slowest view counts.
        rates = [float(json.loads(r.read_text())["samples_per_s"]) for r in results]
        row.state, row.measured = "finished", min(rates)
    return row


def run_peers(spec: TestbedSpec, models: list[str], rounds: int, logs: Path) -> list[Row]:
    """Both peers on every model, each on a fresh testbed without Asteroid's services."""
    rows = []
    for model in models:
        for peer in PEERS:
            t0 = time.monotonic()
            with Testbed(spec, logs / f"{spec.name}-peers") as bed:
                bed.up(services=False)
                row = run_peer(bed, model, peer, rounds, timeout_s=900)
            print(
                f"{spec.name} {model} {peer}: {row.state} {row.measured or 0:.1f} samples/s "
                f"{row.note} [{time.monotonic() - t0:.0f} s]",
                flush=True,
            )
            rows.append(row)
    return rows


def memory_case(rounds: int, logs: Path, peers: bool = True) -> list[Row]:
    """A Nano-like device whose limit GPipe's plan exceeds and Asteroid's respects."""
    base = preset("env-d", "1gbit")
    devices = [
        d.model_copy(update={"memory_bytes": TIGHT_NANO}) if d.kind == "Jetson Nano" else d
        for d in base.devices
    ]
    spec = base.model_copy(update={"name": "env-d-tight", "devices": devices})
    rows = run_testbed(spec, ["mobilenet_v2"], rounds, logs)
    return rows + (run_peers(spec, ["mobilenet_v2"], rounds, logs) if peers else [])


def speedups(rows: list[Row]) -> dict[tuple[str, str, str], float]:
    """Asteroid's measured speedup over each baseline that finished, per testbed and model."""
    out = {}
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if (x.testbed, x.model, x.planner) == (r.testbed, r.model, "asteroid")
            ),
            None,
        )
        if r.planner != "asteroid" and ref and ref.measured and r.measured:
            out[(r.testbed, r.model, r.planner)] = ref.measured / r.measured
    return out


def _find(rows: list[Row], testbed: str, model: str, planner: str) -> Row | None:
    return next(
        (r for r in rows if (r.testbed, r.model, r.planner) == (testbed, model, planner)), None
    )


def peer_cell(row: Row | None) -> str:
    """A peer's samples/s, or why it has none: "OOM" as the paper marks it, or the failure."""
    if row is None:
        return ""
    if row.measured is not None:
        return f"{row.measured:.1f}"
    if row.note.startswith("OOM"):
        return "OOM"
    return row.note or "failed"


def peer_columns(rows: list[Row], testbed: str, model: str) -> dict[str, str]:
    """Each peer's samples/s cell and Asteroid's speedup over it, for one testbed and model."""
    ups = speedups(rows)
    out = {}
    for peer, mode in PEERS.items():
        out[f"{mode}_samples_per_s"] = peer_cell(_find(rows, testbed, model, peer))
        up = ups.get((testbed, model, peer))
        out[f"asteroid_over_{mode}"] = "" if up is None else f"{up:.2f}"
    return out


def _aim(rows: list[Row], testbed: str, model: str) -> str:
    aim = AIMS.get((testbed, model))
    if aim is None:
        return ""
    up = speedups(rows).get((testbed, model, "torch-ddp"))
    verdict = "not measured" if up is None else ("met" if up >= aim else "missed")
    return f">= {aim:g}x DDP: {verdict}"


def peer_table(rows: list[Row]) -> list[str]:
    """Markdown lines: Asteroid's plan against torch DDP and torch pipelining."""
    lines = [
        "",
        "## Asteroid against the peers a user would pick",
        "",
        "| testbed | model | asteroid samples/s | torch DDP samples/s | torch pipelining "
        "samples/s | asteroid / DDP | asteroid / pipelining | aim |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups = dict.fromkeys((r.testbed, r.model) for r in rows if r.planner in PEERS)
    for testbed, model in groups:
        cols = peer_columns(rows, testbed, model)
        ref = _find(rows, testbed, model, "asteroid")
        ddp, pipe = cols["asteroid_over_ddp"], cols["asteroid_over_pipe"]
        lines.append(
            f"| {testbed} | {model} | {_fmt(ref.measured if ref else None)} | "
            f"{cols['ddp_samples_per_s']} | {cols['pipe_samples_per_s']} | "
            f"{ddp and ddp + 'x'} | {pipe and pipe + 'x'} | {_aim(rows, testbed, model)} |"
        )
    return lines


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "x" if x is None else format(x, spec)


def write_markdown(path: Path, rows: list[Row], command: str) -> None:
    ups = speedups(rows)
    lines = [
        "# Real training on the edge testbed",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python "
        f"{platform.python_version()}",
        "",
        "| testbed | model | planner | samples/s | simulated | measured/sim | asteroid speedup "
        "| peak MiB (max device) | stages | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        up = ups.get((r.testbed, r.model, r.planner))
        peak = max(r.peak_mib.items(), key=lambda kv: kv[1]) if r.peak_mib else None
        lines.append(
            f"| {r.testbed} | {r.model} | {r.planner} | {_fmt(r.measured)} | "
            f"{_fmt(r.simulated)} | {_fmt(r.ratio, '.2f')} | "
            f"{'' if up is None else f'{up:.2f}x'} | "
            f"{'' if peak is None else f'{peak[1]:.0f} ({peak[0]})'} | {r.stages} | {r.note} |"
        )
    if any(r.planner in PEERS for r in rows):
        lines += peer_table(rows)
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "testbed",
                "model",
                "planner",
                "state",
                "samples_per_s",
                "simulated",
                "ratio",
                "peak_mib",
                "stages",
                "note",
                *peer_columns([], "", ""),
            ]
        )
        for r in rows:
            w.writerow(
                [
                    r.testbed,
                    r.model,
                    r.planner,
                    r.state,
                    r.measured,
                    r.simulated,
                    r.ratio,
                    ";".join(f"{d}={m:.0f}" for d, m in r.peak_mib.items()),
                    r.stages,
                    r.note,
                    *peer_columns(rows, r.testbed, r.model).values(),
                ]
            )


def write_plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r.testbed, r.model) for r in rows))
    fig, ax = plt.subplots(figsize=(2.6 * len(groups) + 2, 4))
    names = (*PLANNERS, *PEERS)
    width = 0.8 / len(names)
    colors = plt.get_cmap("tab10")
    for j, name in enumerate(names):
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r.testbed, r.model, r.planner) == (*g, name)), None)
            x = i + (j - (len(names) - 1) / 2) * width
            if r is None:
                continue
            if r.measured:
                ax.bar(x, r.measured, width, color=colors(j), label=name if i == 0 else None)
                if r.simulated:
                    ax.plot(x, r.simulated, "_", color="black", markersize=12)
            else:
                ax.plot(x, 0.5, "x", color=colors(j), markersize=9, markeredgewidth=2)
    ax.set_xticks(range(len(groups)), [f"{t}\n{m}" for t, m in groups], fontsize=8)
    ax.set_ylabel("samples/s (bars: measured; -: simulated)")
    ax.legend(ncol=len(names), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.15))
    ax.grid(True, axis="y", alpha=0.3)
    fig.text(0.5, 0.005, "x: the plan failed (see edge.md)", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/edge"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="mobilenet_v2 on Env D only")
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=None, help="only these models"
    )
    parser.add_argument("--memory-case", action="store_true", help="also the tight-memory run")
    parser.add_argument(
        "--no-peers", action="store_true", help="skip torch DDP and torch pipelining"
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench-edge builds network namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    presets = PRESETS[1:] if args.quick else PRESETS
    models = ["mobilenet_v2"] if args.quick else (args.models or list(MODELS))
    rows: list[Row] = []
    for name, link in presets:
        spec = preset(name, link)
        rows += run_testbed(spec, models, args.rounds, args.out / "logs")
        if not args.no_peers:
            rows += run_peers(spec, models, args.rounds, args.out / "logs")
    if args.memory_case:
        rows += memory_case(args.rounds, args.out / "logs", peers=not args.no_peers)
    command = "python -m tests.bench.bench_edge " + " ".join(argv or sys.argv[1:])
    write_markdown(args.out / "edge.md", rows, command.strip())
    write_csv(args.out / "edge.csv", rows)
    write_plot(args.out / "edge.png", rows)
    print((args.out / "edge.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
