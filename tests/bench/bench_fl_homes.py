"""Eco-FL against FedAvg, FedAsync, FedAT and Astraea with real homes on the edge testbed.

    python -m tests.bench.bench_fl_homes [--out DIR] [--quick] [--budget S] [--updates N]
        [--wan 20mbit] [--deadline HH:MM]   (root; make bench-fl-homes)
    python -m tests.bench.bench_fl_homes --out DIR --replot   (outputs again from DIR)

Unlike `bench_fl` (a virtual clock), every home here is a real coordinator with real
workers inside emulated devices (namespace, shaped link, CPU quota, memory limit):
home 0 pipelines the model over two devices, the others train on one, at CPU quotas
from a Xavier NX's down to a Nano's. A home's devices sit on a 1 Gbit/s link to the
host side, where the homes' coordinators run; the federation service runs inside a
device of its own whose link (`--wan`) every home<->federation transfer crosses.
Each strategy runs at Dirichlet alpha 0.1 and 0.5 (same split seed) for the same
wall-clock budget (or until its updates are done); then Eco-FL and FedAT run once
more while the fastest single-device home is throttled half-way, so regrouping
shows. Outputs: DIR/results.md, DIR/results.json, DIR/curves.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.bench.deadline import deadline_check

STRATEGIES = ("ecofl", "fedavg", "fedasync", "fedat", "astraea")
ALPHAS = (0.1, 0.5)
TARGETS = (0.7, 0.8, 0.9)
SUBNET = "10.83.0.0/24"
"""No other testbed bench's subnet: they may share a machine."""
MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 16, "hidden": 64},
}
OPTIMIZER: dict[str, Any] = {"kind": "sgd", "lr": 0.3, "momentum": 0.0}
BATCH = 32
LOCAL_ROUNDS = 10
FED_PORT = 5600
"""The federation's port inside its device (plus the run's index: no TIME_WAIT clash)."""


@dataclass(frozen=True)
class Home:
    """One home: its devices (name, kind, cores) and its plan's stages over them."""

    devices: tuple[tuple[str, str, float], ...]
    stages: tuple[tuple[int, int, str], ...]


HOMES: tuple[Home, ...] = (
    Home((("h0a", "TX2", 0.25), ("h0b", "TX2", 0.25)), ((0, 2, "h0a"), (2, 4, "h0b"))),
    Home((("h1a", "Xavier NX", 0.4),), ((0, 4, "h1a"),)),
    Home((("h2a", "TX2", 0.3),), ((0, 4, "h2a"),)),
    Home((("h3a", "Nano", 0.13),), ((0, 4, "h3a"),)),
    Home((("h4a", "Nano", 0.13),), ((0, 4, "h4a"),)),
)
"""CPU quotas of env-c's kinds (`services.testbed.spec`: NX 0.468, TX2 0.369, Nano 0.13),
trimmed so that all devices and the federation's stay near 1.6 of the two cores."""
FED_DEVICE = ("fed", "server", 0.2)
SLOW_HOME = 1
"""The home throttled half-way in the slow-down runs: the fastest single-device one."""
SLOW_CPU = 0.05
START_ALLOWANCE_S = 240.0
"""Longest the processes may take to start (torch imports under small CPU quotas)."""


@dataclass(frozen=True)
class RunSpec:
    """One run: a strategy at a label skew, with or without the mid-run slow-down."""

    strategy: str
    alpha: float
    slowdown: bool = False

    @property
    def label(self) -> str:
        """A short name for logs and folders."""
        return f"{self.strategy}-a{self.alpha:g}" + ("-slow" if self.slowdown else "")


@dataclass
class RunResult:
    """What one run measured: the federation's curve, cut where the run stopped."""

    strategy: str
    alpha: float
    slowdown: bool
    times: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    regroups: list[tuple[float, int, str, int | None]] = field(default_factory=list)
    slowed_at_s: float | None = None
    wall_s: float = 0.0
    state: str = "done"
    note: str = ""


def plan_runs(quick: bool) -> list[RunSpec]:
    """The runs in order: the grid, then the slow-down pair (quick: 2 strategies, 1 alpha)."""
    if quick:
        return [RunSpec("ecofl", 0.5), RunSpec("fedavg", 0.5), RunSpec("ecofl", 0.5, True)]
    grid = [RunSpec(s, a) for a in ALPHAS for s in STRATEGIES]
    return [*grid, RunSpec("ecofl", 0.5, True), RunSpec("fedat", 0.5, True)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --quick shortens the budget unless one is given."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/fl-homes"))
    parser.add_argument("--quick", action="store_true", help="2 strategies, alpha 0.5, short")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds per run on the federation's clock"
    )
    parser.add_argument("--updates", type=int, default=1000, help="global updates per run at most")
    parser.add_argument("--wan", default="20mbit", help="the federation device's link rate")
    parser.add_argument("--deadline", default="", help="UTC HH:MM: start no run after it")
    parser.add_argument("--replot", action="store_true", help="only redo the outputs")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 60.0 if args.quick else 120.0
    if args.budget <= 0 or args.updates < 1:
        parser.error("--budget and --updates must be positive")
    return args


# --- the pure part: curves to rows, rows to a table -------------------------------


def curve_of(entries: Sequence[dict[str, Any]]) -> tuple[list[float], list[float], list[int]]:
    """(time_s, accuracy, version) of each fl-metrics entry that changed the global model.

    Probe rounds (Eco-FL measuring a home outside every group) keep the version; they
    are left out so that a curve is one point per global model.
    """
    times: list[float] = []
    accs: list[float] = []
    versions: list[int] = []
    for e in entries:
        if versions and int(e["version"]) == versions[-1]:
            continue
        times.append(float(e["time_s"]))
        accs.append(float(e["accuracy"]))
        versions.append(int(e["version"]))
    return times, accs, versions


def regroup_events(entries: Sequence[dict[str, Any]]) -> list[tuple[float, int, str, int | None]]:
    """(time_s, home, what, group) of every regrouping the federation reported."""
    out = []
    for e in entries:
        for home, what, group in e.get("regroups") or []:
            out.append((float(e["time_s"]), int(home), str(what), group))
    return out


def time_to(times: Sequence[float], accs: Sequence[float], target: float) -> float | None:
    """Wall-clock seconds (since the federation started) of the first model at `target`."""
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


def row(r: RunResult) -> dict[str, Any]:
    """The table's cells of one run."""
    return {
        "strategy": r.strategy,
        "alpha": r.alpha,
        "slowdown": r.slowdown,
        **{f"t{int(t * 100)}": time_to(r.times, r.accuracies, t) for t in TARGETS},
        "final": r.accuracies[-1] if r.accuracies else None,
        "best": max(r.accuracies) if r.accuracies else None,
        "first_s": r.times[1] if len(r.times) > 1 else None,
        "updates": r.versions[-1] if r.versions else 0,
        "regroups": len(r.regroups),
        "end_s": r.times[-1] if r.times else None,
        "state": r.state,
    }


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: Sequence[RunResult]) -> list[str]:
    """results.md's table: one line per run, time to each target, final accuracy, updates."""
    targets = " | ".join(f"time to {t:g} (s)" for t in TARGETS)
    lines = [
        f"| strategy | alpha | slow-down | first update (s) | {targets} | final acc | best acc "
        "| updates | regroup events | last update (s) | state |",
        "|" + "---|" * (10 + len(TARGETS)),
    ]
    for r in results:
        c = row(r)
        times = " | ".join(_cell(c[f"t{int(t * 100)}"], ".0f") for t in TARGETS)
        lines.append(
            f"| {c['strategy']} | {c['alpha']:g} | {'yes' if c['slowdown'] else 'no'} "
            f"| {_cell(c['first_s'], '.0f')} | {times} "
            f"| {_cell(c['final'], '.3f')} | {_cell(c['best'], '.3f')} | {c['updates']} "
            f"| {c['regroups']} | {_cell(c['end_s'], '.0f')} | {c['state']} |"
        )
    return lines


def write_outputs(out: Path, header: dict[str, Any], results: Sequence[RunResult]) -> None:
    """results.md and curves.png from what was measured (also --replot)."""
    devices = "; ".join(
        f"home {h}: " + ", ".join(f"{n} ({k}) {c:g} cores" for n, k, c in home.devices)
        for h, home in enumerate(HOMES)
    )
    notes = [
        f"# {header.get('title', 'Federated learning across real homes on the edge testbed')}",
        "",
        f"- command: `{header.get('command', '')}`",
        f"- date: {header.get('date', '')}; machine: {header.get('machine', '')}",
        f"- homes: {devices}; home links 1 Gbit/s; home 0 pipelines fl_cnn over 2 devices",
        f"- federation: its own device ({FED_DEVICE[2]:g} cores), link {header.get('wan', '')}"
        ", crossed by every home<->federation transfer; coordinators on the host side",
        f"- per run: {header.get('budget', '')} s wall-clock budget or "
        f"{header.get('updates', '')} updates; {LOCAL_ROUNDS} local rounds per home round, "
        f"batch {BATCH}, sgd lr {OPTIMIZER['lr']}; digits, Dirichlet alpha, split seed 0",
        f"- slow-down runs: home {SLOW_HOME}'s devices drop to {SLOW_CPU:g} cores at half "
        "the budget",
        "- times are seconds since the federation service started (homes' start-up included);"
        " accuracy is the global model's on the held-out digits",
        "",
        *table(results),
        "",
    ]
    notes += [f"- {r.strategy} a{r.alpha:g}: {r.note}" for r in results if r.note]
    (out / "results.md").write_text("\n".join(notes) + "\n")
    write_plot(out / "curves.png", results)


def write_plot(path: Path, results: Sequence[RunResult]) -> None:
    """Accuracy against wall-clock: one panel per alpha, one for the slow-down runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (f"alpha {a:g}", [r for r in results if r.alpha == a and not r.slowdown]) for a in ALPHAS
    ]
    panels.append(("slow-down (alpha 0.5)", [r for r in results if r.slowdown]))
    panels = [(t, rs) for t, rs in panels if rs]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.5 * max(1, len(panels)), 4))
    axes_list = list(axes) if len(panels) > 1 else [axes]
    for ax, (title, runs) in zip(axes_list, panels, strict=False):
        for r in runs:
            ax.step(r.times, r.accuracies, where="post", label=r.strategy)
            if r.slowed_at_s is not None:
                ax.axvline(r.slowed_at_s, color="grey", linestyle=":")
            for t, _, _, _ in r.regroups:
                ax.plot([t], [r.accuracies[0] if r.accuracies else 0], "kx")
        ax.set_title(title)
        ax.set_xlabel("wall-clock s since the federation started")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: Path, header: dict[str, Any], results: Sequence[RunResult]) -> None:
    """results.json after every run, so that a stopped bench keeps what it measured."""
    data = {**header, "runs": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(data, indent=1))


def load(out: Path) -> tuple[dict[str, Any], list[RunResult]]:
    """results.json's header and runs."""
    data = json.loads((out / "results.json").read_text())
    runs = [RunResult(**r) for r in data.pop("runs")]
    for r in runs:
        r.regroups = [(float(t), int(h), str(what), g) for t, h, what, g in r.regroups]
    return data, runs


# --- the effectful part: the testbed, the processes, one run ---------------------


def testbed_spec(wan: str) -> Any:
    """Every home device on a 1 Gbit/s link, the federation's device on `wan`."""
    from services.testbed.spec import TestbedDevice, TestbedSpec

    devices = [
        TestbedDevice(name=n, kind=k, cpu=c, memory_bytes="512MiB", bandwidth_bps="1gbit")
        for home in HOMES
        for n, k, c in home.devices
    ]
    name, kind, cpu = FED_DEVICE
    devices.append(
        TestbedDevice(
            name=name,
            kind=kind,
            cpu=cpu,
            memory_bytes="768MiB",
            bandwidth_bps=wan,
            latency_ms=10.0,
        )
    )
    return TestbedSpec(name="fl-homes", subnet=SUBNET, devices=devices)


class Bench:
    """The testbed and its Redis, kept across runs; each run's processes are its own."""

    def __init__(self, bed: Any, redis_url: str, out: Path, args: argparse.Namespace) -> None:
        self.bed, self.redis_url, self.out, self.args = bed, redis_url, out, args
        self.home_keys = out / "keys-homes"
        self.fed_keys = out / "keys-federation"
        self.procs: list[subprocess.Popen[bytes]] = []

    def make_keys(self) -> None:
        """One key set for the homes' clusters, one for the federation (a pair per home)."""
        from common.curve import create_key_set

        for d in (self.home_keys, self.fed_keys):
            shutil.rmtree(d, ignore_errors=True)
        create_key_set(self.home_keys, [n for h in HOMES for n, _, _ in h.devices])
        create_key_set(self.fed_keys, [f"home-{h}" for h in range(len(HOMES))])

    def env(self, cluster: str, coordinator: str) -> dict[str, str]:
        """What a home's services are told: its Redis prefix, coordinator and keys."""
        return {
            "ASTEROID_REDIS_URL": self.redis_url,
            "ASTEROID_CLUSTER": cluster,
            "ASTEROID_COORDINATOR": coordinator,
            "ASTEROID_KEYS": str(self.home_keys),
            "ASTEROID_HEARTBEAT_S": "0.5",
            "ASTEROID_LOG_FORMAT": "json",
            "ASTEROID_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }

    def in_device(self, dev: str, name: str, env: dict[str, str], cmd: list[str]) -> None:
        """Start `cmd` inside device `dev` with `env` on top of this process's environment."""
        pairs = [f"{k}={v}" for k, v in env.items()]
        self.procs.append(self.bed.start(dev, name, ["env", *pairs, *cmd]))

    def run(self, spec: RunSpec, index: int, stop: threading.Event) -> RunResult:
        """Start the federation and the homes, follow the curve, stop all of it."""
        from common.procs import spawn, stop_all

        logs = self.out / "logs" / spec.label
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        result = RunResult(spec.strategy, spec.alpha, spec.slowdown)
        fid, prefix = "digits", f"flh{os.getpid()}-{index}"
        fed_addr = f"tcp://{self.bed.address(FED_DEVICE[0])}:{FED_PORT + index}"
        t0 = time.monotonic()
        try:
            self._start_federation(spec, fid, prefix, fed_addr, logs)
            for h in range(len(HOMES)):
                self._start_home(spec, h, fid, prefix, fed_addr, logs, spawn)
            self._follow(spec, result, f"{prefix}-fed", fid, stop)
        finally:
            stop_all(self.procs, timeout_s=10.0)
            self.procs.clear()
            for n, _, c in HOMES[SLOW_HOME].devices:
                with contextlib.suppress(Exception):
                    self.bed.slow(n, c)
            result.wall_s = time.monotonic() - t0
            self._read_curve(result, f"{prefix}-fed", fid)
        return result

    def _start_federation(
        self, spec: RunSpec, fid: str, prefix: str, address: str, logs: Path
    ) -> None:
        fed = {
            "federation_id": fid,
            "model": MODEL,
            "seed": 1,
            "homes": len(HOMES),
            "strategy": spec.strategy,
            "updates": self.args.updates,
            "round_timeout_s": 120,
        }
        path = logs / "federation.yaml"
        path.write_text(yaml.safe_dump(fed))
        cmd = [sys.executable, "-m", "services.federation.main", "--bind", address]
        cmd += ["--spec", str(path), "--keys", str(self.fed_keys), "--exit-when-done"]
        env = {
            "ASTEROID_REDIS_URL": self.redis_url,
            "ASTEROID_CLUSTER": f"{prefix}-fed",
            "ASTEROID_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            "ASTEROID_DONE_GRACE_S": "10",
        }
        self.in_device(FED_DEVICE[0], f"{spec.label}/federation", env, cmd)

    def _start_home(
        self,
        spec: RunSpec,
        h: int,
        fid: str,
        prefix: str,
        fed_addr: str,
        logs: Path,
        spawn: Callable[..., subprocess.Popen[bytes]],
    ) -> None:
        from services.testbed.bed import _free_port

        bridge = self.bed.bridge
        coordinator = f"tcp://{bridge}:{_free_port(bridge)}"
        env = self.env(f"{prefix}-h{h}", coordinator)
        for n, _, _ in HOMES[h].devices:
            worker = [sys.executable, "-m", "services.worker.main", "--device", n]
            self.in_device(n, f"{spec.label}/{n}", env, worker)
        job = {
            "job_id": "learn",
            "model": MODEL,
            "seed": 0,
            "rounds": LOCAL_ROUNDS,
            "global_batch": BATCH,
            "micro_batch": BATCH // 2,
            "optimizer": OPTIMIZER,
            "dataset": {"kind": "digits", "homes": len(HOMES), "home": h, "alpha": spec.alpha},
            "federation": {
                "federation_id": fid,
                "address": fed_addr,
                "home": h,
                "timeout_s": 300,
                "keys": str(self.fed_keys),
            },
        }
        stages = [
            {"start": a, "end": b, "devices": [{"device": d, "share": 1}]}
            for a, b, d in HOMES[h].stages
        ]
        plan = {"global_batch": BATCH, "microbatches": 2, "stages": stages}
        (logs / f"job-h{h}.yaml").write_text(yaml.safe_dump(job))
        (logs / f"plan-h{h}.json").write_text(json.dumps(plan))
        cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
        cmd += ["--shutdown-workers", "--job", str(logs / f"job-h{h}.yaml")]
        cmd += ["--plan", str(logs / f"plan-h{h}.json")]
        self.procs.append(spawn(cmd, {**os.environ, **env}, logs / f"coordinator-h{h}.log"))

    def _follow(
        self, spec: RunSpec, result: RunResult, cluster: str, fid: str, stop: threading.Event
    ) -> None:
        """Until the federation exits, the budget is spent or the bench is stopped."""
        from common.store import Store

        federation = self.procs[0]
        budget, started = float(self.args.budget), time.monotonic()
        zero: float | None = None  # monotonic time of the federation's clock's 0
        store = Store(self.redis_url, cluster)
        try:
            while not stop.is_set():
                entries = store.read("fl-metrics", fid)
                if zero is None and entries:
                    zero = time.monotonic() - float(entries[-1]["time_s"])
                now = 0.0 if zero is None else time.monotonic() - zero
                if spec.slowdown and result.slowed_at_s is None and now >= budget / 2:
                    for n, _, _ in HOMES[SLOW_HOME].devices:
                        self.bed.slow(n, SLOW_CPU)
                    result.slowed_at_s = now
                if federation.poll() is not None:
                    result.state = "done" if federation.returncode == 0 else "failed"
                    if federation.returncode != 0:
                        result.note = f"federation exited {federation.returncode}"
                    return
                if now >= budget:
                    result.state = "budget"
                    return
                if time.monotonic() - started > budget + START_ALLOWANCE_S:
                    result.state = "timeout"
                    result.note = f"no federation clock within {START_ALLOWANCE_S:.0f} s"
                    return
                time.sleep(0.5)
            result.state = "stopped"
        finally:
            store.close()

    def _read_curve(self, result: RunResult, cluster: str, fid: str) -> None:
        from common.store import Store

        store = Store(self.redis_url, cluster)
        try:
            entries = store.read("fl-metrics", fid)
        finally:
            store.close()
        result.times, result.accuracies, result.versions = curve_of(entries)
        result.regroups = regroup_events(entries)
        failed = sorted({h for e in entries for h in e.get("failed") or []})
        if failed:
            result.note += f" homes failing a round: {failed}"


def run_all(args: argparse.Namespace, header: dict[str, Any], results: list[RunResult]) -> None:
    """Bring the testbed up, run every planned run that starts before the deadline, down."""
    from common.embedded_redis import EmbeddedRedis
    from services.testbed.bed import Testbed
    from tests.bench.bench_recovery import _on_term

    stop = threading.Event()
    _on_term(stop)
    past = deadline_check(args.deadline)
    spec = testbed_spec(args.wan)
    with Testbed(spec, args.out / "logs" / "testbed", stop=stop) as bed:
        bed.up(services=False)
        with EmbeddedRedis(host=bed.bridge) as redis:
            bench = Bench(bed, redis.url, args.out, args)
            bench.make_keys()
            for i, run in enumerate(plan_runs(args.quick)):
                if past():
                    r = RunResult(run.strategy, run.alpha, run.slowdown, state="skipped")
                    r.note = "not run: past the deadline"
                else:
                    print(f"{run.label}: starting", flush=True)
                    r = bench.run(run, i, stop)
                    c = row(r)
                    print(
                        f"{run.label}: {r.state} final {c['final']} updates {c['updates']} "
                        f"to targets {[c[f't{int(t * 100)}'] for t in TARGETS]} "
                        f"regroups {c['regroups']} "
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
        save(args.out, header, results)
        write_outputs(args.out, header, results)
    print((args.out / "results.md").read_text())
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
