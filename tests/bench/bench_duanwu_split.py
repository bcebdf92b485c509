"""Duan & Wu's split device on real compute: where forward and backward meet, and epoch time.

    python -m tests.bench.bench_duanwu_split [--out DIR] [--quick] [--rounds N] [--reps N]
        [--repeats N] [--models M ...] [--deadline HH:MM]   (root, cgroup v1 cpu controller)

Part 1, where forward and backward meet (the premise of Lemma 1 / Theorem 1:
a phase given a share s of a device takes its whole-device time divided by s).
For each model, one layer range (two stages' worth of an even four-way split,
layers [L/4, 3L/4)) on one core: the whole-core forward time F and backward
time B of a micro-batch, each run alone; then, for beta on a grid, a forward
and a backward of that range started together on two threads, the forward
thread held to beta of one core and the backward thread to 1 - beta by cgroup
v1 CPU quotas (two child cgroups of a bench cgroup, the threads' TIDs in their
`tasks`, cpu.shares in the same ratio, both threads pinned to one core), each
thread with one intra-op thread. The crossing of the two lane
times (interpolated) is compared with `optimal_beta(F, B)`, and the pair's
time measured at the crossing, at the optimal beta and at beta 0.5 with F + B
run one after the other. Every cgroup made is removed on exit.

Part 2, epoch time of plain and split pipelining at depth 4 (the shape of
their Fig. 5). Four emulated devices (namespace, shaped 1 Gbit/s link, CPU
quota, memory limit) run the same 4-stage plan per model (Algorithm 1's
partition over one device per stage, from a profile measured here at one
thread and scaled by each device's quota): plain (no forward_share), each
device's optimal beta (`DuanWuPlanner.betas`, clipped to the plan's range)
and beta 0.5; same rounds and seed, each variant `--repeats` times in
alternating order. Samples/s come from the coordinator's round metrics
(median round after the first); the epoch is `EPOCH_SAMPLES`.
The simulator's prediction for the same plan is recorded beside it.

Outputs: DIR/table.md, DIR/results.json, DIR/meet.png, DIR/epoch.png.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from common.zoo import ModelSpec, build_model
from services.planner.base import stage
from services.planner.cost import CostModel
from services.planner.duanwu import DuanWuPlanner, StageTerms, algorithm1, clip_beta, optimal_beta
from tests.bench.bench_async import samples_per_s
from tests.bench.deadline import deadline_check

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
BENCH_SHARES = 262_144
"""cpu.shares of the bench cgroup (the kernel's most): other processes on the lanes' core
yield to them, so a lane's time measures its quota, not this machine's other load."""
"""The kernel's smallest cfs_quota_us."""
GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MODELS: dict[str, dict[str, Any]] = {
    # name: zoo spec and the micro-batch (samples)
    "mobilenet_v2": {"spec": {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}, "micro": 8},
    "resnet18": {"spec": {"name": "resnet18"}, "micro": 8},
}
VARIANTS = ("plain", "optimal", "half")
"""Part 2's runs of one plan: no forward_share, each device's optimal beta, beta 0.5."""
DEVICES = 4
DEVICE_CPU = 0.3
"""Cores of each emulated device (the four sum to 1.2 of this machine's cores)."""
DEVICE_MEMORY = 1 << 30
LINK_BPS = 1e9
SUBNET = "10.86.0.0/24"
"""No other testbed bench's subnet: they may share a machine."""
GLOBAL_BATCH = 64
EPOCH_SAMPLES = 50_000
"""The stated epoch: CIFAR-10's training set (both models take 32x32 images)."""
PAPER_PCT_SHORTER = {"AlexNet": 5.7, "GoogLeNet": 7.3}
"""Their Fig. 5 at depth 4: how much shorter a split epoch is (simulated), %."""


# --- part 1: cgroup v1 lanes -------------------------------------------------------


def cpu_cgroup_writable(root: Path = CPU_ROOT) -> bool:
    """Whether this process may make cgroup v1 cpu groups with CFS quotas under `root`."""
    return (
        os.geteuid() == 0
        and (root / "cpu.cfs_quota_us").exists()
        and (root / "tasks").exists()
        and os.access(root, os.W_OK)
    )


def own_cpu_cgroup(root: Path = CPU_ROOT) -> Path:
    """The cpu cgroup this process is in (where moved threads go back to)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return root / path.lstrip("/")
    return root


class LaneCgroups:
    """A bench cgroup with a forward and a backward child, each with its own CFS quota.

    `remove` moves every thread it was given back to the cgroup it came from
    and deletes the groups; it runs at most once: called directly, at the
    `with` block's exit (also on an error) or at interpreter exit.
    """

    def __init__(self, root: Path = CPU_ROOT, period_us: int = PERIOD_US) -> None:
        self.root, self.period_us = root, period_us
        self.base = root / f"duanwu-split-{os.getpid()}-{threading.get_native_id()}"
        self.lanes = {"F": self.base / "forward", "B": self.base / "backward"}
        self.parent = own_cpu_cgroup(root)
        self.moved: list[int] = []
        self._removed = False

    def __enter__(self) -> LaneCgroups:
        atexit.register(self.remove)
        try:
            self.base.mkdir()
            # the lanes' core is theirs while they run (they never take more than that core)
            (self.base / "cpu.shares").write_text(str(BENCH_SHARES))
            for path in self.lanes.values():
                path.mkdir()
                (path / "cpu.cfs_period_us").write_text(str(self.period_us))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def set_share(self, lane: str, share: float | None, weigh: bool = False) -> None:
        """Give `lane` ("F" or "B") `share` of one core per period (None: no limit).

        With `weigh`, the group's cpu.shares is in the same proportion, so two
        lanes contending for one core divide it by share even between the
        quota's checks (the kernel enforces a quota at its tick, 4 ms at 250 Hz).
        """
        quota = -1 if share is None else max(MIN_QUOTA_US, round(share * self.period_us))
        (self.lanes[lane] / "cpu.cfs_quota_us").write_text(str(quota))
        weight = 1024 if share is None or not weigh else max(2, round(share * 1024))
        (self.lanes[lane] / "cpu.shares").write_text(str(weight))

    def move(self, lane: str, tid: int) -> None:
        """Put thread `tid` into `lane`'s cgroup."""
        self.moved.append(tid)
        (self.lanes[lane] / "tasks").write_text(str(tid))

    def remove(self) -> None:
        """Threads back to where they came from, then every group made here removed."""
        if self._removed:
            return
        self._removed = True
        for tid in self.moved:
            with contextlib.suppress(OSError):  # a thread that ended has left already
                (self.parent / "tasks").write_text(str(tid))
        for path in (*self.lanes.values(), self.base):
            if path.exists():
                for _ in range(50):  # a moved thread may take a moment to leave
                    try:
                        path.rmdir()
                        break
                    except OSError:
                        time.sleep(0.02)
        atexit.unregister(self.remove)


class Lane:
    """A thread with one intra-op thread of its own, running what it is given."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._start
        )
        self.tid: int = self._pool.submit(threading.get_native_id).result()

    @staticmethod
    def _start() -> None:
        # PyTorch sets a thread's count from the process-wide one at its first query
        torch.get_num_threads()
        torch.set_num_threads(1)

    def submit(self, fn: Callable[[], tuple[float, float]]) -> Future[tuple[float, float]]:
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class Workload:
    """A layer range of a model with the micro-batch's activation at its input."""

    model: str
    lo: int
    hi: int
    micro: int
    stage: torch.nn.Module
    inputs: torch.Tensor

    def forward(self) -> torch.Tensor:
        """The range's forward as a pipeline stage runs it (autograd graph kept)."""
        x = self.inputs.detach()
        if x.is_floating_point():
            x.requires_grad_(True)
        out: torch.Tensor = self.stage(x)
        return out

    def prepared_backward(self) -> Callable[[], None]:
        """A backward ready to run: the graph is built here, on the caller's thread."""
        for p in self.stage.parameters():
            p.grad = None
        out = self.forward()
        grad = torch.ones_like(out) / out.numel()

        def backward() -> None:
            out.backward(grad)  # type: ignore[no-untyped-call]

        return backward


def workload(model: str, seed: int = 0, registry: dict[str, dict[str, Any]] = MODELS) -> Workload:
    """Layers [L/4, 3L/4) of `model` (from `registry`) with a micro-batch's input activation."""
    from common.data import dataset_for

    cfg = registry[model]
    zoo = build_model(ModelSpec.model_validate(cfg["spec"]), seed)
    n = len(zoo.layers)
    lo, hi = n // 4, max(n // 4 + 1, 3 * n // 4)
    x, _ = dataset_for(zoo, seed).batch(torch.arange(int(cfg["micro"])))
    with torch.no_grad():
        for layer in zoo.layers[:lo]:
            x = layer(x)
    return Workload(model, lo, hi, int(cfg["micro"]), zoo.stage(lo, hi), x)


def _timed(
    fn: Callable[[], object], gate: threading.Barrier | None
) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        if gate is not None:
            gate.wait()
        t0 = time.perf_counter()
        fn()
        return t0, time.perf_counter()

    return run


@dataclass
class Pair:
    """Medians over repetitions of a forward and a backward started together."""

    beta: float
    forward_s: float
    backward_s: float
    pair_s: float


@dataclass
class Meeting:
    """Part 1's figures for one model's layer range."""

    model: str
    layers: tuple[int, int]
    micro: int
    forward_s: float
    backward_s: float
    optimal_beta: float
    grid: list[Pair] = field(default_factory=list)
    crossing_beta: float | None = None
    at_crossing: Pair | None = None
    at_optimal: Pair | None = None

    @property
    def sequential_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def half(self) -> Pair | None:
        return next((p for p in self.grid if abs(p.beta - 0.5) < 1e-9), None)

    def premise(self) -> list[tuple[float, float, float]]:
        """Per beta: measured over modelled (F / beta, B / (1 - beta)) lane time."""
        return [
            (
                p.beta,
                p.forward_s * p.beta / self.forward_s,
                p.backward_s * (1 - p.beta) / self.backward_s,
            )
            for p in self.grid
        ]


def crossing(
    betas: Sequence[float], forward: Sequence[float], backward: Sequence[float]
) -> float | None:
    """Where forward minus backward lane time changes sign (linear between grid points)."""
    diff = [f - b for f, b in zip(forward, backward, strict=True)]
    for i in range(len(diff) - 1):
        a, b = diff[i], diff[i + 1]
        if a == 0:
            return betas[i]
        if a > 0 > b or a < 0 < b:
            return betas[i] + (betas[i + 1] - betas[i]) * a / (a - b)
    return betas[-1] if diff and diff[-1] == 0 else None


class MeetBench:
    """Two lanes in two quota-limited cgroups, timing a layer range's forward and backward."""

    def __init__(
        self, groups: LaneCgroups, reps: int, warmup: int, core: int | None = None
    ) -> None:
        self.groups, self.reps, self.warmup, self.core = groups, reps, warmup, core
        self.lanes = {"F": Lane("forward-lane"), "B": Lane("backward-lane")}
        for name, lane in self.lanes.items():
            groups.move(name, lane.tid)
            if core is not None:  # both lanes on one core: together they get one core at most
                os.sched_setaffinity(lane.tid, {core})

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()

    def alone(self, work: Workload, kind: str) -> float:
        """Median time of one phase run alone on its lane, its cgroup unlimited."""
        self.groups.set_share(kind, None)
        times = []
        for i in range(self.warmup + self.reps):
            fn: Callable[[], object] = work.forward if kind == "F" else work.prepared_backward()
            t0, t1 = self.lanes[kind].submit(_timed(fn, None)).result()
            if i >= self.warmup:
                times.append(t1 - t0)
        return statistics.median(times)

    def pair(self, work: Workload, beta: float) -> Pair:
        """Forward on beta of a core and backward on the rest, started together; medians."""
        self.groups.set_share("F", beta, weigh=self.core is not None)
        self.groups.set_share("B", 1 - beta, weigh=self.core is not None)
        fwd, bwd, pair = [], [], []
        for i in range(self.warmup + self.reps):
            backward = work.prepared_backward()
            gate = threading.Barrier(2)
            f = self.lanes["F"].submit(_timed(work.forward, gate))
            b = self.lanes["B"].submit(_timed(backward, gate))
            (f0, f1), (b0, b1) = f.result(), b.result()
            if i >= self.warmup:
                fwd.append(f1 - f0)
                bwd.append(b1 - b0)
                pair.append(max(f1, b1) - min(f0, b0))
        return Pair(beta, statistics.median(fwd), statistics.median(bwd), statistics.median(pair))

    def meet(self, work: Workload, grid: Sequence[float]) -> Meeting:
        f, b = self.alone(work, "F"), self.alone(work, "B")
        got = Meeting(work.model, (work.lo, work.hi), work.micro, f, b, optimal_beta(f, b))
        got.grid = [self.pair(work, beta) for beta in grid]
        got.crossing_beta = crossing(
            [p.beta for p in got.grid],
            [p.forward_s for p in got.grid],
            [p.backward_s for p in got.grid],
        )
        if got.crossing_beta is not None:
            got.at_crossing = self.pair(work, got.crossing_beta)
        got.at_optimal = self.pair(work, got.optimal_beta)
        return got


def lane_core() -> int:
    """The core both lanes are pinned to: the last this process may use."""
    return max(os.sched_getaffinity(0))


def run_meetings(
    models: Sequence[str],
    grid: Sequence[float],
    reps: int,
    warmup: int,
    period_us: int = PERIOD_US,
    registry: dict[str, dict[str, Any]] = MODELS,
    core: int | None = None,
) -> list[Meeting]:
    """Part 1 for each model; the cgroups are gone when this returns (or raises)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # building the graphs on this thread: one core's worth too
    out = []
    try:
        with LaneCgroups(period_us=period_us) as groups:
            bench = MeetBench(groups, reps, warmup, core)
            try:
                for model in models:
                    t0 = time.monotonic()
                    got = bench.meet(workload(model, registry=registry), grid)
                    print(
                        f"meet {model}: F {got.forward_s * 1e3:.1f} ms, B "
                        f"{got.backward_s * 1e3:.1f} ms, optimal beta {got.optimal_beta:.3f}, "
                        f"crossing {got.crossing_beta} [{time.monotonic() - t0:.0f} s]",
                        flush=True,
                    )
                    out.append(got)
            finally:
                groups.remove()  # threads out of the groups before they end
                bench.close()
    finally:
        torch.set_num_threads(before)
    return out


# --- part 2: epoch time on the testbed ----------------------------------------------


def measure_profile(model: str, registry: dict[str, dict[str, Any]] = MODELS) -> Profile:
    """The model's layers measured here at one thread, at the micro-batch."""
    from services.profiler.layers import profile_model

    cfg = registry[model]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_model(
            ModelSpec.model_validate(cfg["spec"]), [int(cfg["micro"])], repeats=3, warmup=1
        )
    finally:
        torch.set_num_threads(before)


def device_names(count: int = DEVICES) -> list[str]:
    return [f"edge-{i}" for i in range(count)]


def cost_for(
    profile: Profile,
    devices: Sequence[str],
    cpu: float = DEVICE_CPU,
    memory: int = DEVICE_MEMORY,
    link_bps: float = LINK_BPS,
) -> CostModel:
    """The devices as the planner sees them: the one-thread profile slowed by 1 / quota."""
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name=d, memory_bytes=memory, profile="ref", slowdown=1 / cpu)
            for d in devices
        ],
        bandwidth=link_bps / 8,
        latency_s=1e-3,
    )
    return CostModel({"ref": profile}, cluster)


def pipeline_plan(cost: CostModel, micro: int, global_batch: int = GLOBAL_BATCH) -> Plan:
    """Algorithm 1's partition with one device per stage, in the cluster's order."""
    devs = [d.name for d in cost.cluster.devices]
    microbatches = global_batch // micro
    part = algorithm1(StageTerms(cost, tuple((d,) for d in devs), micro, microbatches))
    if part is None:
        raise RuntimeError(f"no {len(devs)}-stage partition fits the devices' memory")
    stages = [
        stage(lo, hi, [d], [1])
        for (lo, hi), d in zip(zip(part.cuts, part.cuts[1:], strict=False), devs, strict=True)
    ]
    return Plan(stages=stages, global_batch=global_batch, microbatches=microbatches)


def variant(plan: Plan, betas: dict[str, float] | None) -> Plan:
    """`plan` with each device's forward share from `betas` (None: not split)."""
    stages = [
        s.model_copy(
            update={
                "devices": [
                    a.model_copy(
                        update={"forward_share": None if betas is None else betas[a.device]}
                    )
                    for a in s.devices
                ]
            }
        )
        for s in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


def variants(cost: CostModel, plan: Plan) -> dict[str, tuple[Plan, dict[str, float] | None]]:
    """The three runs of `plan`, each with the betas it gives its devices."""
    optimal = {d: clip_beta(b) for d, b in DuanWuPlanner.betas(cost, plan).items()}
    half = dict.fromkeys(optimal, 0.5)
    return {
        "plain": (variant(plan, None), None),
        "optimal": (variant(plan, optimal), optimal),
        "half": (variant(plan, half), half),
    }


def simulator_models_split() -> bool:
    """Whether `simulate` scores a plan's forward_share (its source reads the field)."""
    from services.planner import simulator

    return "forward_share" in inspect.getsource(simulator)


def simulated_samples_per_s(plan: Plan, cost: CostModel) -> float | None:
    from services.planner.simulator import simulate

    try:
        return plan.global_batch / simulate(plan, cost).round_s
    except Exception as exc:  # a prediction is a side figure: note it, keep measuring
        print(f"simulator: {exc}", file=sys.stderr)
        return None


def epoch_s(rate: float | None, epoch: int = EPOCH_SAMPLES) -> float | None:
    return None if not rate else epoch / rate


def job_spec(
    model: str, rounds: int, job_id: str, registry: dict[str, dict[str, Any]] = MODELS
) -> dict[str, Any]:
    """The job every variant of `model` runs: same rounds, seed and optimizer."""
    return {
        "job_id": job_id,
        "model": registry[model]["spec"],
        "seed": 1,
        "rounds": rounds,
        "optimizer": {"kind": "sgd", "lr": 0.01},
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    data: dict[str, Any] = plan.model_dump(mode="json", exclude_none=True)
    return data


@dataclass
class EpochRow:
    """One variant of one model's plan in part 2: its runs and their median samples/s."""

    model: str
    variant: str
    betas: dict[str, float] | None
    stages: list[tuple[int, int]]
    samples_per_s: float | None = None
    runs: list[float] = field(default_factory=list)
    """Samples/s of each run (their median is `samples_per_s`)."""
    rounds_s: list[list[float]] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    """This machine's 1-minute load average as each run started."""
    sim_samples_per_s: float | None = None
    wall_s: float = 0.0
    note: str = ""

    def add(self, rate: float | None, rounds: list[float]) -> None:
        """Record one run."""
        self.rounds_s.append(rounds)
        if rate is not None:
            self.runs.append(rate)
            self.samples_per_s = statistics.median(self.runs)

    @property
    def epoch_s(self) -> float | None:
        return epoch_s(self.samples_per_s)

    @property
    def sim_epoch_s(self) -> float | None:
        return epoch_s(self.sim_samples_per_s)


def plan_rows(models: Sequence[str]) -> list[tuple[EpochRow, Plan]]:
    """Every run of part 2 (model by model, the three variants of one plan), not yet run."""
    out = []
    sim = simulator_models_split()
    for model in models:
        cost = cost_for(measure_profile(model), device_names())
        plan = pipeline_plan(cost, int(MODELS[model]["micro"]))
        for name, (p, betas) in variants(cost, plan).items():
            row = EpochRow(model, name, betas, [(s.start, s.end) for s in p.stages])
            if sim or betas is None:
                row.sim_samples_per_s = simulated_samples_per_s(p, cost)
            out.append((row, p))
    return out


def run_order(todo: Sequence[tuple[EpochRow, Plan]], repeats: int) -> list[tuple[EpochRow, Plan]]:
    """Model by model, its variants `repeats` times, every other pass reversed (drift cancels)."""
    out: list[tuple[EpochRow, Plan]] = []
    for model in dict.fromkeys(r.model for r, _ in todo):
        mine = [t for t in todo if t[0].model == model]
        for k in range(repeats):
            out += mine if k % 2 == 0 else mine[::-1]
    return out


class EpochBench:
    """The four emulated devices, a Redis on the bridge, one coordinator per run."""

    def __init__(self, out: Path, rounds: int) -> None:
        from services.testbed.spec import TestbedDevice, TestbedSpec

        self.out, self.rounds = out, rounds
        self.spec = TestbedSpec(
            name="duanwu-split",
            subnet=SUBNET,
            devices=[
                TestbedDevice(
                    name=d,
                    kind="homogeneous",
                    cpu=DEVICE_CPU,
                    memory_bytes=DEVICE_MEMORY,
                    bandwidth_bps=LINK_BPS,
                )
                for d in device_names()
            ],
        )

    def run(
        self, todo: list[tuple[EpochRow, Plan]], past: Callable[[], bool], repeats: int = 1
    ) -> None:
        """Each model's variants `repeats` times, alternating their order (ABC CBA ...)."""
        from common.curve import create_key_set
        from common.embedded_redis import EmbeddedRedis
        from services.testbed.bed import Testbed

        logs = self.out / "logs"
        with Testbed(self.spec, logs / "testbed") as bed:
            bed.up(services=False)
            keys = logs / "keys"
            create_key_set(keys, bed.devices)
            with EmbeddedRedis(host=bed.bridge) as redis:
                for i, (row, plan) in enumerate(run_order(todo, repeats)):
                    if past():
                        row.note = "past the deadline: fewer runs"
                        continue
                    t0 = time.monotonic()
                    row.loads.append(round(os.getloadavg()[0], 2))
                    self.one(bed, redis.url, keys, i, row, plan)
                    row.wall_s += time.monotonic() - t0
                    print(
                        f"epoch {row.model} {row.variant}: {row.runs[-1] if row.runs else 0:.2f} "
                        f"samples/s (sim {row.sim_samples_per_s or 0:.2f}) {row.note} "
                        f"[{time.monotonic() - t0:.0f} s]",
                        flush=True,
                    )

    def one(self, bed: Any, redis_url: str, keys: Path, i: int, row: EpochRow, plan: Plan) -> None:
        from common.procs import spawn, stop_all
        from common.store import Store
        from services.testbed.bed import _free_port

        label = f"{row.model}-{row.variant}"
        logs = self.out / "logs" / label
        logs.mkdir(parents=True, exist_ok=True)
        coordinator = f"tcp://{bed.bridge}:{_free_port(bed.bridge)}"
        cluster = f"dws-{os.getpid()}-{i}"
        env = {
            "ASTEROID_REDIS_URL": redis_url,
            "ASTEROID_CLUSTER": cluster,
            "ASTEROID_COORDINATOR": coordinator,
            "ASTEROID_KEYS": str(keys),
            "ASTEROID_HEARTBEAT_S": "0.5",
            "ASTEROID_LOG_FORMAT": "json",
            "ASTEROID_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        pairs = [f"{k}={v}" for k, v in env.items()]
        procs = []
        job_id = "split"
        (logs / "job.yaml").write_text(yaml.safe_dump(job_spec(row.model, self.rounds, job_id)))
        (logs / "plan.json").write_text(json.dumps(plan_json(plan)))
        try:
            for dev in bed.devices:
                worker = [sys.executable, "-m", "services.worker.main", "--device", dev]
                procs.append(bed.start(dev, f"{label}/{dev}.worker", ["env", *pairs, *worker]))
            cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
            cmd += ["--shutdown-workers", "--job", str(logs / "job.yaml")]
            cmd += ["--plan", str(logs / "plan.json")]
            coord = spawn(cmd, {**os.environ, **env}, logs / "coordinator.log")
            procs.append(coord)
            try:
                code = coord.wait(timeout=900)
            except Exception:
                code = None
            if code != 0:
                row.note = f"coordinator exit {code} (see logs/{label})"
            store = Store(redis_url, cluster)
            try:
                metrics = store.read("metrics", job_id)
            finally:
                store.close()
            row.add(*samples_per_s(metrics, plan.global_batch))
        finally:
            stop_all(procs, timeout_s=10.0)


# --- outputs -------------------------------------------------------------------------


def _f(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _pct(new: float | None, old: float | None) -> str:
    """How much shorter `new` is than `old`, in % (negative: longer)."""
    if new is None or not old:
        return "—"
    return f"{(old - new) / old * 100:+.1f} %"


def meet_table(meetings: Sequence[Meeting]) -> list[str]:
    lines = [
        "## 1. Where forward and backward meet (one core split by cgroup v1 CPU quotas)",
        "",
        "| model | layers | micro | F ms | B ms | optimal beta F/(F+B) "
        "| measured crossing beta | pair ms at crossing | pair ms at optimal beta "
        "| pair ms at beta 0.5 | F+B ms (sequential) | lane time / modelled (min..max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in meetings:
        ratios = [r for _, f, b in m.premise() for r in (f, b)]
        spread = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "—"
        lines.append(
            f"| {m.model} | [{m.layers[0]}, {m.layers[1]}) | {m.micro} | {m.forward_s * 1e3:.1f} | "
            f"{m.backward_s * 1e3:.1f} | {m.optimal_beta:.3f} | {_f(m.crossing_beta, '.3f')} | "
            f"{_f(m.at_crossing.pair_s * 1e3 if m.at_crossing else None)} | "
            f"{_f(m.at_optimal.pair_s * 1e3 if m.at_optimal else None)} | "
            f"{_f(m.half.pair_s * 1e3 if m.half else None)} | {m.sequential_s * 1e3:.1f} | "
            f"{spread} |"
        )
    return lines


def epoch_table(rows: Sequence[EpochRow], sim_split: bool) -> list[str]:
    lines = [
        "## 2. Epoch time, plain vs split pipelining, depth 4, four emulated devices",
        "",
        f"Epoch = {EPOCH_SAMPLES} samples; {DEVICES} devices of {DEVICE_CPU} cores each, 1 Gbit/s "
        f"links, global batch {GLOBAL_BATCH}.",
        "",
        "| model | stages | variant | betas | samples/s (median) | runs | epoch s | vs plain "
        "| simulated epoch s | simulated vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plain = next(x for x in rows if x.model == r.model and x.variant == "plain")
        betas = "—" if r.betas is None else " ".join(f"{b:.2f}" for b in r.betas.values())
        stages = " ".join(f"[{a},{b})" for a, b in r.stages)
        sim = r.sim_epoch_s if (sim_split or r.betas is None) else None
        runs = " / ".join(f"{x:.2f}" for x in r.runs) or "—"
        vs = "" if r is plain else _pct(r.epoch_s, plain.epoch_s)
        sim_vs = "" if r is plain else _pct(sim, plain.sim_epoch_s)
        lines.append(
            f"| {r.model} | {stages} | {r.variant} | {betas} | {_f(r.samples_per_s, '.2f')} | "
            f"{runs} | {_f(r.epoch_s)} | {vs} | {_f(sim)} | {sim_vs} |"
            + (f" {r.note}" if r.note else "")
        )
    return lines


NOTES = [
    "",
    "Notes:",
    "- Part 1: both lanes are threads of one process with one intra-op thread each, in two "
    f"cgroup v1 cpu groups (cfs_period_us {PERIOD_US}, quotas beta and 1 - beta of it, "
    "cpu.shares in the same ratio), both pinned to one core; the bench group's cpu.shares is "
    f"{BENCH_SHARES} so other processes on that core yield to the lanes (without it this "
    "machine's other load, not the quota, set the lane times). The kernel enforces a quota at "
    "its tick (4 ms at 250 Hz): a lane alone can overrun its quota by up to a tick per period. "
    "F and B are each phase alone on that core; times are medians over repetitions; a pair's "
    "time runs from the common start to the later end. 'lane time / modelled' is the lane's "
    "time over F / beta (forward) or B / (1 - beta) (backward) on the grid: 1.00 is Theorem 1's "
    "premise exactly.",
    "- Part 2: each emulated device is a cgroup with a fractional CPU quota and its worker "
    "runs one intra-op thread, so a split device's two lanes share the device's quota by OS "
    "time-slicing, not in the ratio beta; beta only decides which tasks overlap. Samples/s: "
    "global batch over the median round after the first, the median over the runs (variants "
    "run in alternating order, ABC CBA ABC); the devices have no priority over this machine's "
    "other load (results.json has the load average at each run). The simulator scores the same "
    "plans from a profile measured here at one thread, each device slowed by 1 / its quota. "
    "Paper (Fig. 5, simulated, depth 4): 5.7 % shorter epochs for AlexNet, 7.3 % for GoogLeNet. "
    "'vs plain': how much shorter than plain (negative: longer).",
]


def write_outputs(
    out: Path,
    meetings: Sequence[Meeting],
    rows: Sequence[EpochRow],
    header: dict[str, Any],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sim_split = bool(header.get("simulator_models_forward_share"))
    lines = [
        "# Duan & Wu's split device on real compute",
        "",
        f"- command: `{header['command']}`",
        f"- date: {header['date']}",
        f"- machine: {header['machine']}",
        f"- simulator models forward_share: {'yes' if sim_split else 'no'}",
        "",
    ]
    if meetings:
        lines += [*meet_table(meetings), ""]
    if rows:
        lines += [*epoch_table(rows, sim_split), ""]
    lines += NOTES
    (out / "table.md").write_text("\n".join(lines) + "\n")
    data = {
        **header,
        "meet": [
            {
                **asdict(m),
                "sequential_s": m.sequential_s,
                "premise": [
                    {"beta": b, "forward_over_model": f, "backward_over_model": g}
                    for b, f, g in m.premise()
                ],
            }
            for m in meetings
        ],
        "epoch": [{**asdict(r), "epoch_s": r.epoch_s, "sim_epoch_s": r.sim_epoch_s} for r in rows],
    }
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    if meetings:
        plot_meet(out / "meet.png", meetings)
    if rows:
        plot_epoch(out / "epoch.png", rows, sim_split)


def plot_meet(path: Path, meetings: Sequence[Meeting]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(meetings), figsize=(5 * len(meetings), 4), squeeze=False)
    for ax, m in zip(axes[0], meetings, strict=True):
        betas = [p.beta for p in m.grid]
        ax.plot(betas, [p.forward_s * 1e3 for p in m.grid], "o-", label="forward lane")
        ax.plot(betas, [p.backward_s * 1e3 for p in m.grid], "s-", label="backward lane")
        fine = [0.05 + 0.9 * i / 100 for i in range(101)]
        ax.plot(fine, [m.forward_s / b * 1e3 for b in fine], ":", color="C0", label="F / beta")
        ax.plot(
            fine,
            [m.backward_s / (1 - b) * 1e3 for b in fine],
            ":",
            color="C1",
            label="B / (1 - beta)",
        )
        ax.axhline(m.sequential_s * 1e3, color="grey", lw=0.8, label="F + B sequential")
        ax.axvline(m.optimal_beta, color="k", ls="--", lw=0.8, label="optimal beta F/(F+B)")
        if m.crossing_beta is not None:
            ax.axvline(m.crossing_beta, color="r", lw=0.8, label="measured crossing")
        ax.set_yscale("log")
        ax.set_xlabel("beta (forward's share of one core)")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{m.model} layers [{m.layers[0]}, {m.layers[1]}), micro {m.micro}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_epoch(path: Path, rows: Sequence[EpochRow], sim_split: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, ax = plt.subplots(figsize=(2.8 * len(models) + 2, 4))
    width = 0.8 / len(VARIANTS)
    for j, name in enumerate(VARIANTS):
        for i, model in enumerate(models):
            r = next((x for x in rows if (x.model, x.variant) == (model, name)), None)
            plain = next((x for x in rows if (x.model, x.variant) == (model, "plain")), None)
            if r is None:
                continue
            x = i + (j - (len(VARIANTS) - 1) / 2) * width
            if r.epoch_s is not None:
                ax.bar(x, r.epoch_s, width, color=f"C{j}", label=name if i == 0 else None)
                if r is not plain and plain is not None:
                    ax.text(
                        x,
                        r.epoch_s,
                        _pct(r.epoch_s, plain.epoch_s),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            sim = r.sim_epoch_s if (sim_split or r.betas is None) else None
            if sim is not None:
                ax.plot(x, sim, "_", color="black", markersize=14)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel(f"epoch time, s ({EPOCH_SAMPLES} samples)")
    ax.set_title("depth 4: plain vs split (bars: measured; -: simulated)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def header_for(command: str) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"load {os.getloadavg()[0]:.2f}, torch {torch.__version__}",
        "simulator_models_forward_share": simulator_models_split(),
        "epoch_samples": EPOCH_SAMPLES,
        "devices": {"count": DEVICES, "cpu": DEVICE_CPU, "memory_bytes": DEVICE_MEMORY},
        "global_batch": GLOBAL_BATCH,
        "period_us": PERIOD_US,
        "paper_fig5_pct_shorter": PAPER_PCT_SHORTER,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/duanwu-split"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per part-2 run")
    parser.add_argument("--reps", type=int, default=None, help="part-1 repetitions per beta")
    parser.add_argument(
        "--repeats", type=int, default=None, help="part-2 runs per variant (order alternates)"
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--skip-meet", action="store_true", help="no part 1")
    parser.add_argument("--skip-epoch", action="store_true", help="no part 2")
    parser.add_argument("--deadline", default="", help="HH:MM UTC: start no part-2 run after it")
    args = parser.parse_args(argv)
    if not cpu_cgroup_writable():
        print("needs root and a writable cgroup v1 cpu controller", file=sys.stderr)
        return 2
    reps = args.reps or (3 if args.quick else 15)
    rounds = args.rounds or (3 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    command = "python -m tests.bench.bench_duanwu_split " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    header = {**header_for(command.strip()), "reps": reps, "rounds": rounds, "repeats": repeats}
    t0 = time.monotonic()
    meetings = (
        [] if args.skip_meet else run_meetings(args.models, GRID, reps, warmup=2, core=lane_core())
    )
    header["lane_core"] = lane_core()
    rows: list[EpochRow] = []
    if not args.skip_epoch:
        todo = plan_rows(args.models)
        rows = [r for r, _ in todo]
        write_outputs(args.out, meetings, rows, header)  # part 1 is kept if part 2 fails
        EpochBench(args.out, rounds).run(todo, deadline_check(args.deadline), repeats)
    header["runtime_s"] = round(time.monotonic() - t0, 1)
    write_outputs(args.out, meetings, rows, header)
    print((args.out / "table.md").read_text())
    return 0 if all(r.samples_per_s for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
