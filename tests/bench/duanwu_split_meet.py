"""Part 1 of the split-device benchmark: where forward and backward meet on ONE core.

For each model, one layer range (layers [L/4, 3L/4)) on one core: the
whole-core forward time F and backward time B of a micro-batch, each alone;
then, for beta on a grid, a forward and a backward of that range started
together on two threads, the forward thread held to beta of one core and the
backward thread to 1 - beta by cgroup v1 CPU quotas (two child cgroups of a
bench cgroup, the threads' TIDs in their `tasks`, cpu.shares in the same
ratio, both threads pinned to one core), each with one intra-op thread. The
crossing of the two lane times is compared with `optimal_beta(F, B)`, and the
pair's time at the crossing, at the optimal beta and at 0.5 with F + B run one
after the other. Every cgroup made is removed on exit. Not in the default run
(`--meet`): it checks Theorem 1's premise, which the two-core parts do not need.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.zoo import ModelSpec, build_model
from services.planner.duanwu import optimal_beta
from tests.bench.duanwu_split_common import MODELS, fmt

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
BENCH_SHARES = 262_144
"""cpu.shares of the bench cgroup (the kernel's most): other processes on the lanes' core
yield to them, so a lane's time measures its quota, not this machine's other load."""
"""The kernel's smallest cfs_quota_us."""
GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


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
            f"{m.backward_s * 1e3:.1f} | {m.optimal_beta:.3f} | {fmt(m.crossing_beta, '.3f')} | "
            f"{fmt(m.at_crossing.pair_s * 1e3 if m.at_crossing else None)} | "
            f"{fmt(m.at_optimal.pair_s * 1e3 if m.at_optimal else None)} | "
            f"{fmt(m.half.pair_s * 1e3 if m.half else None)} | {m.sequential_s * 1e3:.1f} | "
            f"{spread} |"
        )
    return lines


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
