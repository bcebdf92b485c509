"""The real-homes FL bench's setting: the homes, their speeds and links, the runs.

The regime is Eco-FL's (ICPP'22 slides): homes whose speeds differ several-fold
(their devices' CPU quotas span ``SPEED_RATIO``), each home behind a link of its own,
rounds of seconds (``LOCAL_ROUNDS`` local rounds of ``BATCH`` samples per home round,
so that a round's timing noise is small against the regrouping band) and one home
that is throttled mid-run. Every run has the throttle, so every strategy faces the
same dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("ecofl", "fedavg", "fedasync", "fedat", "astraea")
ALPHAS = (0.1, 0.5)
"""Dirichlet label skews; the default run does the non-IID 0.1 only (--alphas for more)."""
TARGETS = (0.7, 0.8, 0.9)
SUBNET = "10.83.0.0/24"
"""No other testbed bench's subnet: they may share a machine."""
MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 16, "hidden": 64},
}
OPTIMIZER: dict[str, Any] = {"kind": "sgd", "lr": 0.2, "momentum": 0.0}
BATCH = 64
LOCAL_ROUNDS = 30
"""Local rounds (one batch each) per home round: seconds on the fastest home."""
FED_PORT = 5600
"""The federation's port inside its device (plus the run's index: no TIME_WAIT clash)."""
GROUPS = 2
RT_FRACTION = 0.5
LATENCY_WINDOW = 3
REGROUP_DWELL = 2
"""Eco-FL's band: RT^g = 0.5 L^g, judged on the median of 3 rounds, 2 rounds to move."""


@dataclass(frozen=True)
class Home:
    """One home: its devices (name, kind, cores), its link and its plan's stages."""

    devices: tuple[tuple[str, str, float], ...]
    stages: tuple[tuple[int, int, str], ...]
    link: str


HOMES: tuple[Home, ...] = (
    Home((("h0a", "TX2", 0.2), ("h0b", "TX2", 0.2)), ((0, 2, "h0a"), (2, 4, "h0b")), "100mbit"),
    Home((("h1a", "Xavier NX", 0.4),), ((0, 4, "h1a"),), "100mbit"),
    Home((("h2a", "TX2", 0.2),), ((0, 4, "h2a"),), "50mbit"),
    Home((("h3a", "Nano", 0.1),), ((0, 4, "h3a"),), "20mbit"),
    Home((("h4a", "Nano", 0.06),), ((0, 4, "h4a"),), "10mbit"),
)
"""From a Xavier NX's 0.4 cores down to a Nano at its 5 W mode's 0.06: 6.7x in compute.
Home 0 pipelines over two TX2s. All devices and the federation's stay near 1.4 of the
two cores, so the quotas, not the machine, set the speeds."""
SPEED_RATIO = max(c for h in HOMES for _, _, c in h.devices) / min(
    c for h in HOMES for _, _, c in h.devices
)
FED_DEVICE = ("fed", "server", 0.25)
STARTUP_CPU = 1.0
"""Every device's quota while its processes start (torch's import at 0.06 cores takes
most of a minute); the home's own quota is set before the federation starts."""
SLOW_HOME = 1
"""The home throttled mid-run: the fastest single-device one."""
SLOW_CPU = 0.1
START_ALLOWANCE_S = 180.0
"""Longest the processes may take to start."""


@dataclass(frozen=True)
class RunSpec:
    """One run: a strategy at a label skew, with or without the mid-run slow-down."""

    strategy: str
    alpha: float
    slowdown: bool = True

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
    latencies: list[tuple[float, int, float]] = field(default_factory=list)
    slowed_at_s: float | None = None
    warmup_s: float | None = None
    wall_s: float = 0.0
    state: str = "done"
    note: str = ""


def plan_runs(strategies: tuple[str, ...], alphas: tuple[float, ...]) -> list[RunSpec]:
    """Every strategy at each alpha, all with the mid-run slow-down."""
    return [RunSpec(s, a) for a in alphas for s in strategies]


def federation_spec(strategy: str, fid: str, updates: int) -> dict[str, Any]:
    """The federation's spec file for one run: the same band settings for every strategy."""
    return {
        "federation_id": fid,
        "model": MODEL,
        "seed": 1,
        "homes": len(HOMES),
        "strategy": strategy,
        "groups": GROUPS,
        "rt_fraction": RT_FRACTION,
        "latency_window": LATENCY_WINDOW,
        "regroup_dwell": REGROUP_DWELL,
        "updates": updates,
        "round_timeout_s": 120,
    }


def home_job(h: int, alpha: float, fid: str, fed_addr: str, keys: str) -> dict[str, Any]:
    """Home `h`'s federated job: LOCAL_ROUNDS rounds of BATCH on its Dirichlet share."""
    return {
        "job_id": "learn",
        "model": MODEL,
        "seed": 0,
        "rounds": LOCAL_ROUNDS,
        "global_batch": BATCH,
        "micro_batch": BATCH // 2,
        "optimizer": OPTIMIZER,
        "dataset": {"kind": "digits", "homes": len(HOMES), "home": h, "alpha": alpha},
        "federation": {
            "federation_id": fid,
            "address": fed_addr,
            "home": h,
            "timeout_s": 300,
            "keys": keys,
        },
    }


def home_plan(h: int) -> dict[str, Any]:
    """Home `h`'s plan: its stages over its devices, two micro-batches."""
    stages = [
        {"start": a, "end": b, "devices": [{"device": d, "share": 1}]}
        for a, b, d in HOMES[h].stages
    ]
    return {"global_batch": BATCH, "microbatches": 2, "stages": stages}


def testbed_spec(wan: str) -> Any:
    """Each home's devices on the home's link, the federation's device on `wan`.

    Home devices start at `STARTUP_CPU`; `Bench` sets each home's quota once all
    started, before the federation (at its own quota throughout) starts.
    """
    from services.testbed.spec import TestbedDevice, TestbedSpec

    devices = [
        TestbedDevice(
            name=n, kind=k, cpu=STARTUP_CPU, memory_bytes="512MiB", bandwidth_bps=home.link
        )
        for home in HOMES
        for n, k, _ in home.devices
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
