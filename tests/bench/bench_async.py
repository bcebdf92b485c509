"""Asynchronous pipelining (FTPipeHD, PipeDream) against synchronous on emulated devices.

    python -m tests.bench.bench_async [--out DIR] [--reps N] [--rounds N]
        [--acc-rounds N] [--deadline HH:MM]   (root)

Four emulated devices of the env-d preset (`services.testbed.spec`: a TX2-like
device at 0.5 cores and three Nano-like ones at 0.177; network namespaces,
1 Gbit/s shaped links, cgroup CPU quotas and memory limits) run one pipeline
plan of single-device stages, given by hand (one layer of `fl_cnn` per stage,
the heaviest on the fastest device), for every run: the same plan, seed,
data (scikit-learn's digits) and optimizer (plain SGD at one learning rate for
every mode, `LR`). Each run is a coordinator of its own on the host side and
fresh workers inside the devices; Redis runs on the testbed's bridge.

Part 1, throughput: sync and async on the same plan, global batch and
micro-batches, over a window of `WINDOW` micro-batches a round and over a
longer one of `LONG_WINDOW` (same micro-batch size: fewer pipeline drains per
sample), each `--reps` times, interleaved. Samples/s is the global batch over
the median round of the coordinator's round metrics, the first round skipped;
the table gives the median over the repetitions.

Part 2, held-out accuracy against wall clock, over windows of `ACC_WINDOW`
micro-batches (longer than K_0, so that forwards run on stale versions):
sync, async and async with FTPipeHD's weight aggregation (`aggregate_every`
= K_0), `--acc-rounds` rounds each with an evaluation every `--eval-every`
rounds; seconds count from the evaluation before the first round
(evaluations included, the same number in every mode). Reported: time to
`TARGET` accuracy, final and best accuracy. One more sync run at M times the
learning rate (the step a window's M async updates add up to) is a reference
row of the table, not a curve.

Outputs: DIR/table.md, DIR/results.json, DIR/throughput.png, DIR/accuracy.png;
process logs under DIR/logs. The testbed (namespaces, links, cgroups), its
Redis and every process are removed at the end, also after an error or
SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from tests.bench.deadline import deadline_check

MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 16, "hidden": 64},
}
LAYERS = 4
"""fl_cnn's layers: conv block, conv block, hidden linear, classifier."""
DATA: dict[str, Any] = {"kind": "digits", "homes": 1, "home": 0, "alpha": 1.0}
LR = 0.1
"""Plain SGD (no momentum) at this learning rate in every compared mode: sync takes one
step of the window's mean gradient per round, async one step per micro-batch. In
single-process replays (`tests.reference`) of this job async alone stays stable up to
about this rate (at 0.2 it diverges, at 0.05 it learns more slowly)."""
MICRO = 8
WINDOW = 4
LONG_WINDOW = 16
ACC_WINDOW = LONG_WINDOW
"""Part 2's window: longer than K_0 = 2S - 1 = 7, so that forwards run on stale versions
(with a window of K_0 or fewer micro-batches every forward of a window runs on its first
version, and async is sync with the learning rate times M)."""
SEED = 1
TARGET = 0.9
EVAL_EVERY = 5
AGGREGATE_K0_MULTIPLE = 1
"""aggregate_every = this times K_0 (FTPipeHD: a multiple of the concurrent versions);
updates are counted per window, so it stays at most the window."""
PRESET = "env-d"
SUBNET = "10.89.0.0/24"
"""No other testbed bench's subnet."""
STAGE_DEVICES = ("nano-0", "tx2-0", "nano-1", "nano-2")
"""Stage i (layer i) runs on STAGE_DEVICES[i]: the second conv block, by far the
heaviest layer, on the fastest device."""
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Config:
    """One way of training the plan."""

    name: str
    mode: str
    microbatches: int
    aggregate_every: int = 0
    lr_scale: int = 1

    @property
    def global_batch(self) -> int:
        return MICRO * self.microbatches

    @property
    def lr(self) -> float:
        return LR * self.lr_scale


def k0(devices: int, microbatches: int) -> int:
    """K_0: the first stage's warm-up forwards (Asteroid's 2S-1, never above M)."""
    return max(1, min(2 * devices - 1, microbatches))


def throughput_configs() -> list[Config]:
    """Part 1's configurations: sync and async over a short and a long window."""
    return [
        Config(f"{mode} M={m}", mode, m)
        for m in (WINDOW, LONG_WINDOW)
        for mode in ("sync", "async")
    ]


def accuracy_configs(stages: int = LAYERS) -> list[Config]:
    """Part 2's configurations over windows of `ACC_WINDOW` micro-batches: sync, async,
    async with aggregation every `AGGREGATE_K0_MULTIPLE` K_0 updates, all at `LR`; then,
    for reference only (not one of the compared curves), sync at M times `LR`: the step
    that the window's M async updates add up to."""
    agg = AGGREGATE_K0_MULTIPLE * k0(stages, ACC_WINDOW)
    return [
        Config("sync", "sync", ACC_WINDOW),
        Config("async", "async", ACC_WINDOW),
        Config("async+agg", "async", ACC_WINDOW, agg),
        Config(f"sync, lr x{ACC_WINDOW}", "sync", ACC_WINDOW, lr_scale=ACC_WINDOW),
    ]


def plan_for(devices: Sequence[str], microbatches: int) -> dict[str, Any]:
    """One single-device stage per device, in `devices`' order, fl_cnn's layers split evenly
    (one layer each with four devices)."""
    if not 1 <= len(devices) <= LAYERS:
        raise ValueError(f"fl_cnn has {LAYERS} layers: give 1 to {LAYERS} devices")
    cuts = [round(i * LAYERS / len(devices)) for i in range(len(devices) + 1)]
    return {
        "global_batch": MICRO * microbatches,
        "microbatches": microbatches,
        "stages": [
            {"start": cuts[i], "end": cuts[i + 1], "devices": [{"device": d, "share": 1}]}
            for i, d in enumerate(devices)
        ],
    }


def job_for(cfg: Config, job_id: str, rounds: int, eval_every: int = 0) -> dict[str, Any]:
    """The job of one run: everything but the mode and the window is the same in all."""
    job: dict[str, Any] = {
        "job_id": job_id,
        "model": MODEL,
        "dataset": DATA,
        "seed": SEED,
        "rounds": rounds,
        "global_batch": cfg.global_batch,
        "micro_batch": MICRO,
        "optimizer": {"kind": "sgd", "lr": cfg.lr, "momentum": 0.0},
        "mode": cfg.mode,
        "eval_every": eval_every,
        "elastic": False,
        "adapt": False,  # the plan stays the one given
        "replicate_every": 0,
    }
    if cfg.aggregate_every:
        job["aggregate_every"] = cfg.aggregate_every
    return job


# --- metrics -> numbers ----------------------------------------------------------


def samples_per_s(
    metrics: Sequence[dict[str, Any]], global_batch: int
) -> tuple[float | None, list[float]]:
    """Global batch over the median round after the first, and every round's seconds."""
    rounds = [float(m["round_s"]) for m in metrics if "loss" in m and "round_s" in m]
    steady = rounds[1:]
    if not steady:
        return None, rounds
    return global_batch / statistics.median(steady), rounds


def accuracy_curve(metrics: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(seconds since the first evaluation, held-out accuracy) of every evaluation."""
    evals = [m for m in metrics if "eval_accuracy" in m and "time" in m]
    if not evals:
        return [], []
    t0 = float(evals[0]["time"])
    return [float(m["time"]) - t0 for m in evals], [float(m["eval_accuracy"]) for m in evals]


def time_to(times: Sequence[float], accs: Sequence[float], target: float) -> float | None:
    """Seconds to the first evaluation at or above `target`."""
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


@dataclass
class Run:
    """One job: what ran and what its metrics say."""

    part: str
    config: str
    mode: str
    microbatches: int
    aggregate_every: int
    rep: int
    lr: float = LR
    samples_per_s: float | None = None
    rounds_s: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""

    @property
    def final(self) -> float | None:
        return self.accuracies[-1] if self.accuracies else None

    @property
    def best(self) -> float | None:
        return max(self.accuracies) if self.accuracies else None


class Runner(Protocol):
    """Runs one job on one plan to its end; (coordinator exit code, metrics stream)."""

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]]]: ...


def run_one(
    runner: Runner, part: str, cfg: Config, rep: int, job: dict[str, Any], plan: dict[str, Any]
) -> Run:
    """Run `job` through `runner` and read its metrics into a Run."""
    run = Run(part, cfg.name, cfg.mode, cfg.microbatches, cfg.aggregate_every, rep, cfg.lr)
    label = f"{part}-{cfg.name.replace(' ', '').replace('=', '').replace('+', '-')}-{rep}"
    t0 = time.monotonic()
    try:
        code, metrics = runner(label, job, plan)
    except Exception as exc:  # one failed run keeps the others
        code, metrics = None, []
        run.note = f"{type(exc).__name__}: {exc}"[:300]
    run.wall_s = time.monotonic() - t0
    if code != 0 and not run.note:
        run.note = f"coordinator exit {code} (logs/{label})"
    run.samples_per_s, run.rounds_s = samples_per_s(metrics, cfg.global_batch)
    run.times, run.accuracies = accuracy_curve(metrics)
    print(
        f"{part} {cfg.name} #{rep}: {run.samples_per_s or 0:.1f} samples/s, "
        f"final acc {run.final if run.final is not None else float('nan'):.3f} "
        f"{run.note} [{run.wall_s:.0f} s]",
        flush=True,
    )
    return run


def throughput_part(
    runner: Runner,
    devices: Sequence[str],
    rounds: int,
    reps: int,
    past: Callable[[], bool] = lambda: False,
    save: Callable[[list[Run]], None] = lambda _: None,
    configs: Sequence[Config] | None = None,
) -> list[Run]:
    """Part 1: every configuration `reps` times, interleaved (rep 0 of each, then rep 1...)."""
    runs: list[Run] = []
    for rep in range(reps):
        for cfg in configs or throughput_configs():
            if past():
                continue
            job = job_for(cfg, "tput", rounds)
            runs.append(
                run_one(runner, "throughput", cfg, rep, job, plan_for(devices, cfg.microbatches))
            )
            save(runs)
    return runs


def accuracy_part(
    runner: Runner,
    devices: Sequence[str],
    rounds: int,
    eval_every: int = EVAL_EVERY,
    past: Callable[[], bool] = lambda: False,
    save: Callable[[list[Run]], None] = lambda _: None,
    configs: Sequence[Config] | None = None,
) -> list[Run]:
    """Part 2: each configuration once, evaluated every `eval_every` rounds."""
    runs: list[Run] = []
    for cfg in configs or accuracy_configs(len(devices)):
        if past():
            continue
        job = job_for(cfg, "acc", rounds, eval_every)
        runs.append(run_one(runner, "accuracy", cfg, 0, job, plan_for(devices, cfg.microbatches)))
        save(runs)
    return runs


# --- outputs ---------------------------------------------------------------------


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def throughput_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per configuration of part 1: the median samples/s over its repetitions."""
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(r.config for r in runs if r.part == "throughput"):
        mine = [r for r in runs if r.part == "throughput" and r.config == name]
        rates = [r.samples_per_s for r in mine if r.samples_per_s]
        out.append(
            {
                "config": name,
                "mode": mine[0].mode,
                "microbatches": mine[0].microbatches,
                "global_batch": MICRO * mine[0].microbatches,
                "median": statistics.median(rates) if rates else None,
                "reps": rates,
            }
        )
    for r in out:
        sync = next(
            (
                s["median"]
                for s in out
                if s["mode"] == "sync" and s["microbatches"] == r["microbatches"]
            ),
            None,
        )
        r["vs_sync"] = r["median"] / sync if r["median"] and sync else None
    return out


def table(runs: Sequence[Run]) -> list[str]:
    """table.md's two tables."""
    lines = [
        "| throughput run | mode | micro-batches/window | global batch | samples/s (median) "
        "| repetitions | vs sync (same window) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in throughput_rows(runs):
        reps = ", ".join(f"{x:.1f}" for x in r["reps"]) or "-"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['microbatches']} | {r['global_batch']} "
            f"| {_f(r['median'])} | {reps} | {_f(r['vs_sync'], '.2f')} |"
        )
    lines += [
        "",
        f"| accuracy run | lr | aggregate_every | samples/s | time to {TARGET:g} (s) | final acc "
        "| best acc | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in runs:
        if a.part != "accuracy":
            continue
        lines.append(
            f"| {a.config} | {a.lr:g} | {a.aggregate_every or '-'} | {_f(a.samples_per_s)} "
            f"| {_f(time_to(a.times, a.accuracies, TARGET), '.0f')} | {_f(a.final, '.3f')} "
            f"| {_f(a.best, '.3f')} | {a.wall_s:.0f} |"
        )
    return lines


def write_outputs(out: Path, header: dict[str, Any], runs: Sequence[Run]) -> None:
    """table.md, results.json, throughput.png and accuracy.png."""
    out.mkdir(parents=True, exist_ok=True)
    save_json(out, header, runs)
    notes = [
        "# Async (FTPipeHD-style) against sync pipelining on emulated devices",
        "",
        f"- command: `{header.get('command', '')}`",
        f"- date: {header.get('date', '')}; machine: {header.get('machine', '')}",
        f"- testbed: {header.get('testbed', '')}",
        f"- plan: {header.get('plan', '')}; K_0 by window M: {header.get('k0', '')}",
        f"- model fl_cnn on digits (held-out split), seed {SEED}, micro-batch {MICRO}, "
        f"sgd lr {LR:g} momentum 0 in every compared mode (the `lr x{ACC_WINDOW}` row is a "
        "reference: sync at the step M async updates add up to)",
        f"- throughput: {header.get('rounds', '')} rounds a run, first skipped, median round; "
        f"accuracy: {header.get('acc_rounds', '')} rounds, evaluation every "
        f"{header.get('eval_every', '')}; seconds from the evaluation before round 1",
        "",
        *table(runs),
        "",
    ]
    notes += [f"- {r.part} {r.config} #{r.rep}: {r.note}" for r in runs if r.note]
    if "runtime_s" in header:
        notes.append(f"- bench runtime: {header['runtime_s']:.0f} s")
    (out / "table.md").write_text("\n".join(notes) + "\n")
    plot_throughput(out / "throughput.png", runs)
    plot_accuracy(out / "accuracy.png", runs)


def save_json(out: Path, header: dict[str, Any], runs: Sequence[Run]) -> None:
    data = {**header, "throughput": throughput_rows(runs), "runs": [asdict(r) for r in runs]}
    (out / "results.json").write_text(json.dumps(data, indent=1))


def plot_throughput(path: Path, runs: Sequence[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = throughput_rows(runs)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    names = [r["config"] for r in rows]
    ax.bar(range(len(rows)), [r["median"] or 0 for r in rows], color="tab:blue", alpha=0.8)
    for i, r in enumerate(rows):
        ax.plot([i] * len(r["reps"]), r["reps"], "k.", markersize=6)
    ax.set_xticks(range(len(rows)), names)
    ax.set_ylabel("samples/s (bar: median; dots: repetitions)")
    ax.set_title("throughput on one plan (env-d, 4 stages)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(path: Path, runs: Sequence[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        if r.part == "accuracy" and r.times and r.lr == LR:
            ax.plot(r.times, r.accuracies, marker=".", label=r.config)
    ax.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("wall-clock s since training started")
    ax.set_ylabel("held-out accuracy (digits)")
    ax.set_title(f"fl_cnn on digits, sgd lr {LR:g}, window {ACC_WINDOW} micro-batches")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- runners ---------------------------------------------------------------------


def _worker_env(
    redis_url: str, cluster: str, coordinator: str, keys: Path | None
) -> dict[str, str]:
    env = {
        "ASTEROID_REDIS_URL": redis_url,
        "ASTEROID_CLUSTER": cluster,
        "ASTEROID_COORDINATOR": coordinator,
        "ASTEROID_HEARTBEAT_S": "0.5",
        "ASTEROID_LOG_FORMAT": "json",
        "ASTEROID_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    if keys is not None:
        env["ASTEROID_KEYS"] = str(keys)
    return env


def _read_metrics(redis_url: str, cluster: str, job_id: str) -> list[dict[str, Any]]:
    from common.store import Store

    store = Store(redis_url, cluster)
    try:
        return list(store.read("metrics", job_id))
    finally:
        store.close()


def _write_inputs(logs: Path, job: dict[str, Any], plan: dict[str, Any]) -> tuple[Path, Path]:
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "job.yaml").write_text(yaml.safe_dump(job))
    (logs / "plan.json").write_text(json.dumps(plan))
    return logs / "job.yaml", logs / "plan.json"


class TestbedRunner:
    """Runs jobs on an up testbed (no services): fresh workers and a coordinator per run."""

    __test__ = False

    def __init__(self, bed: Any, redis_url: str, keys: Path, logs: Path) -> None:
        self.bed, self.redis_url, self.keys, self.logs = bed, redis_url, keys, logs
        self.count = 0

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]]]:
        from common.procs import spawn, stop_all
        from services.testbed.bed import _free_port

        self.count += 1
        logs = self.logs / label
        job_file, plan_file = _write_inputs(logs, job, plan)
        coordinator = f"tcp://{self.bed.bridge}:{_free_port(self.bed.bridge)}"
        cluster = f"abench-{os.getpid()}-{self.count}"
        env = _worker_env(self.redis_url, cluster, coordinator, self.keys)
        pairs = [f"{k}={v}" for k, v in env.items()]
        procs = []
        try:
            for stage in plan["stages"]:
                dev = stage["devices"][0]["device"]
                worker = [sys.executable, "-m", "services.worker.main", "--device", dev]
                procs.append(self.bed.start(dev, f"{label}/{dev}.worker", ["env", *pairs, *worker]))
            cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
            cmd += ["--shutdown-workers", "--job", str(job_file), "--plan", str(plan_file)]
            coord = spawn(cmd, {**os.environ, **env}, logs / "coordinator.log")
            procs.append(coord)
            code = coord.wait(timeout=RUN_TIMEOUT_S)
            return code, _read_metrics(self.redis_url, cluster, str(job["job_id"]))
        finally:
            stop_all(procs, timeout_s=10.0)


class LocalRunner:
    """Runs jobs on loopback (no emulation, no root): the smoke test's runner."""

    def __init__(self, redis_url: str, logs: Path, timeout_s: float = 120.0) -> None:
        self.redis_url, self.logs, self.timeout_s = redis_url, logs, timeout_s
        self.clusters: list[str] = []

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]]]:
        from tests.cluster import LocalCluster

        logs = self.logs / label
        logs.mkdir(parents=True, exist_ok=True)
        cluster_name = f"abench-{os.getpid()}-{len(self.clusters)}"
        self.clusters.append(cluster_name)
        cluster = LocalCluster(logs, self.redis_url, cluster_name)
        try:
            cluster.start_workers([s["devices"][0]["device"] for s in plan["stages"]])
            cluster.start_coordinator(job, plan)
            code = cluster.wait("coordinator", self.timeout_s)
            return code, _read_metrics(self.redis_url, cluster_name, str(job["job_id"]))
        finally:
            cluster.close()

    def forget(self) -> None:
        """Delete every key the runs left in Redis."""
        import redis

        r = redis.Redis.from_url(self.redis_url)
        try:
            for name in self.clusters:
                keys = list(r.scan_iter(match=f"asteroid:{name}:*", count=1000))
                if keys:
                    r.delete(*keys)
        finally:
            r.close()


@contextmanager
def testbed_runner(out: Path) -> Iterator[tuple[TestbedRunner, Any]]:
    """The env-d testbed (own subnet) with a Redis on its bridge; removed on exit."""
    from common.curve import create_key_set
    from common.embedded_redis import EmbeddedRedis
    from services.testbed.bed import Testbed
    from services.testbed.spec import preset

    spec = preset(PRESET, "1gbit").model_copy(update={"name": "async-bench", "subnet": SUBNET})
    logs = out / "logs"
    with Testbed(spec, logs / "testbed") as bed:
        bed.up(services=False)
        keys = logs / "keys"
        create_key_set(keys, bed.devices)
        with EmbeddedRedis(host=bed.bridge) as redis:
            yield TestbedRunner(bed, redis.url, keys, logs), spec


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the testbed's cleanup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/async"))
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each throughput run")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of a throughput run")
    parser.add_argument("--acc-rounds", type=int, default=150, help="rounds of an accuracy run")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--deadline", default="", help="UTC HH:MM: start no run after it")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_async builds network namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    command = "python -m tests.bench.bench_async " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    header: dict[str, Any] = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "rounds": args.rounds,
        "acc_rounds": args.acc_rounds,
        "eval_every": args.eval_every,
        "lr": LR,
        "micro_batch": MICRO,
        "k0": {m: k0(LAYERS, m) for m in (WINDOW, LONG_WINDOW)},
    }
    past = deadline_check(args.deadline)
    t0 = time.monotonic()
    runs: list[Run] = []

    def save(part: list[Run]) -> None:
        save_json(args.out, header, [*runs, *part])

    args.out.mkdir(parents=True, exist_ok=True)
    with testbed_runner(args.out) as (runner, spec):
        header["testbed"] = (
            ", ".join(
                f"{d.name} ({d.kind}) {d.cpu:g} cores {d.memory_bytes >> 20} MiB"
                for d in spec.devices
            )
            + f"; links {spec.devices[0].bandwidth_bps / 1e9:g} Gbit/s"
        )
        header["plan"] = " | ".join(f"layer {i}: {d}" for i, d in enumerate(STAGE_DEVICES))
        runs += throughput_part(runner, STAGE_DEVICES, args.rounds, args.reps, past, save)
        runs += accuracy_part(runner, STAGE_DEVICES, args.acc_rounds, args.eval_every, past, save)
    header["runtime_s"] = round(time.monotonic() - t0, 1)
    write_outputs(args.out, header, runs)
    print((args.out / "table.md").read_text())
    return 0 if runs and all(r.samples_per_s for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
