"""Edge devices and environments from the papers, as data the planners can run on.

Asteroid (MobiCom'24) evaluates on Jetson Nano, TX2 and Xavier NX boards grouped
into four environments (its §6) over 100 Mbps and 1 Gbps links; Galaxy
(INFOCOM'24) runs on Jetson Nano CPUs in three frequency modes (its Tables II
and III) over 125 Mbps links. We have one kind of CPU core, not these boards, so a device is the
profiled core (taken as the reference kind) slowed by the ratio of peak
throughputs: `slowdown(kind, reference)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError
from common.profile import ClusterSpec, DeviceSpec

__all__ = [
    "DEVICE_KINDS",
    "ENVIRONMENTS",
    "GALAXY_ENVIRONMENTS",
    "GALAXY_HOMOGENEOUS_BUDGET",
    "GALAXY_LINK_BPS",
    "JETSON_NANO",
    "JETSON_TX2",
    "JETSON_XAVIER_NX",
    "LINK_SPEEDS_BPS",
    "NANO_L",
    "NANO_M",
    "NANO_S",
    "DeviceKind",
    "GalaxyDevice",
    "cluster_for",
    "device_kind",
    "environment",
    "galaxy_devices",
    "slowdown",
]

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceKind:
    """A kind of edge device: its memory, peak compute and where the figures come from.

    Attributes:
        name: Human name, also the key of `DEVICE_KINDS`.
        memory_bytes: Physical memory (shared by CPU and GPU on a Jetson); for
            Galaxy's Nano modes, the memory budget the paper gives them.
        tflops: Peak throughput in TFLOPS; only ratios between kinds are used.
        source: Citation of the figures.
        prefix: Stem of the device names `cluster_for` gives, e.g. "nano" -> "nano-0".

    """

    name: str
    memory_bytes: int
    tflops: float
    source: str
    prefix: str


# Peak FP16 CUDA-core throughput as the vendors state it (CUDA cores x 2 FLOP x
# boost clock x 2 for FP16), the numbers Asteroid's Table 1 lists for its
# devices. Real training speed differs from peak, but we only use the ratios
# between kinds, so the speed of each emulated device relative to the
# reference is derived from these figures and nothing else.
_TABLE_1 = "Asteroid (MobiCom'24) Table 1; NVIDIA Jetson module data sheets"

JETSON_NANO = DeviceKind("Jetson Nano", 4 * GiB, 0.472, _TABLE_1, "nano")
JETSON_TX2 = DeviceKind("Jetson TX2", 8 * GiB, 1.33, _TABLE_1, "tx2")
JETSON_XAVIER_NX = DeviceKind("Xavier NX", 8 * GiB, 1.69, _TABLE_1, "nx")

# Galaxy (Ye et al., INFOCOM'24) runs on Jetson Nanos' quad-core Cortex-A53 CPUs
# (not their GPUs) in three CPU frequency modes, Table II: Nano-S 403 MHz, Nano-M
# 825 MHz, Nano-L 1.47 GHz. Peak fp32 is 4 cores x clock x 8 FLOP/cycle (NEON
# FMA on 4 lanes), so the speed ratios are the clock ratios, 1 : 0.56 : 0.27.
# Memory is the paper's per-device budget (§IV-A; "GB" read as GiB, as the
# Nano's 4 GB is above): 1.5 / 1.2 / 0.7 GiB in the heterogeneous environments.
_GALAXY = "Galaxy (INFOCOM'24) Table II (CPU frequency modes) and §IV-A (memory budgets)"


def _nano_cpu_tflops(clock_ghz: float) -> float:
    return 4 * clock_ghz * 8 / 1000


NANO_L = DeviceKind("Nano-L", int(1.5 * GiB), _nano_cpu_tflops(1.47), _GALAXY, "nano-l")
NANO_M = DeviceKind("Nano-M", int(1.2 * GiB), _nano_cpu_tflops(0.825), _GALAXY, "nano-m")
NANO_S = DeviceKind("Nano-S", int(0.7 * GiB), _nano_cpu_tflops(0.403), _GALAXY, "nano-s")

DEVICE_KINDS: dict[str, DeviceKind] = {
    k.name: k for k in (JETSON_NANO, JETSON_TX2, JETSON_XAVIER_NX, NANO_L, NANO_M, NANO_S)
}
"""Every known kind by name."""

# Asteroid §6: the four heterogeneous environments, fastest kind first.
ENVIRONMENTS: dict[str, tuple[tuple[str, int], ...]] = {
    "A": (("Jetson Nano", 5),),
    "B": (("Xavier NX", 3), ("Jetson TX2", 2)),
    "C": (("Xavier NX", 1), ("Jetson TX2", 2), ("Jetson Nano", 3)),
    "D": (("Jetson TX2", 1), ("Jetson Nano", 3)),
}
"""Asteroid's environments: (kind name, count) per kind."""

# Galaxy's Table III, named apart from Asteroid's A-D: A-C homogeneous, D-F not.
GALAXY_ENVIRONMENTS: dict[str, tuple[tuple[str, int], ...]] = {
    "Galaxy-A": (("Nano-M", 2),),
    "Galaxy-B": (("Nano-M", 3),),
    "Galaxy-C": (("Nano-M", 4),),
    "Galaxy-D": (("Nano-L", 1), ("Nano-M", 1)),
    "Galaxy-E": (("Nano-L", 1), ("Nano-S", 1)),
    "Galaxy-F": (("Nano-L", 1), ("Nano-M", 1), ("Nano-S", 1)),
}
"""Galaxy's environments (Table III): (kind name, count) per kind, fastest first."""

GALAXY_HOMOGENEOUS_BUDGET = int(1.5 * GiB)
"""Nano-M's memory budget in Galaxy's homogeneous environments A-C (§IV-A)."""

GALAXY_LINK_BPS = 125e6
"""The intra-cluster bandwidth of Galaxy's main comparisons (§IV-B, §IV-C), bits/s."""


@dataclass(frozen=True)
class GalaxyDevice:
    """One device of a Galaxy environment as the planner and emulator see it.

    Attributes:
        name: Device name, kind prefix and index ("nano-l-0").
        kind: Its CPU frequency mode.
        slowdown: Times slower than a Nano-L for the same work.
        budget_bytes: Its memory budget, scaled as asked.

    """

    name: str
    kind: DeviceKind
    slowdown: float
    budget_bytes: int


LINK_SPEEDS_BPS: tuple[float, ...] = (100e6, 1e9)
"""The link speeds Asteroid evaluates under, in bits per second."""


def device_kind(name: str) -> DeviceKind:
    """The kind called `name`; ConfigError lists the known kinds otherwise."""
    try:
        return DEVICE_KINDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown device kind {name!r}; known: {', '.join(DEVICE_KINDS)}"
        ) from None


def environment(env: str) -> tuple[tuple[DeviceKind, int], ...]:
    """The (kind, count) pairs of environment `env` (Asteroid's or Galaxy's)."""
    spec = ENVIRONMENTS.get(env) or GALAXY_ENVIRONMENTS.get(env)
    if spec is None:
        known = [*ENVIRONMENTS, *GALAXY_ENVIRONMENTS]
        raise ConfigError(f"unknown environment {env!r}; known: {', '.join(known)}")
    return tuple((device_kind(name), count) for name, count in spec)


def _memory_in(env: str, kind: DeviceKind) -> int:
    """A kind's memory in `env`: Galaxy gives Nano-M more in its homogeneous environments."""
    homogeneous = len(GALAXY_ENVIRONMENTS.get(env, ())) == 1
    return GALAXY_HOMOGENEOUS_BUDGET if homogeneous and kind is NANO_M else kind.memory_bytes


def galaxy_devices(env: str, memory_scale: float = 1.0) -> tuple[GalaxyDevice, ...]:
    """The devices of Galaxy environment `env` ("Galaxy-A".."Galaxy-F"), fastest first.

    Slowdowns are relative to a Nano-L; `memory_scale` multiplies each budget, so
    a small model can be planned against proportionally small devices.

    Raises:
        ConfigError: If `env` is not a Galaxy environment or the scale is not positive.

    """
    if env not in GALAXY_ENVIRONMENTS:
        raise ConfigError(
            f"unknown Galaxy environment {env!r}; known: {', '.join(GALAXY_ENVIRONMENTS)}"
        )
    if not memory_scale > 0:
        raise ConfigError(f"memory_scale must be positive, got {memory_scale}")
    return tuple(
        GalaxyDevice(
            name=f"{kind.prefix}-{i}",
            kind=kind,
            slowdown=slowdown(kind, NANO_L),
            budget_bytes=max(1, int(_memory_in(env, kind) * memory_scale)),
        )
        for kind, count in environment(env)
        for i in range(count)
    )


def slowdown(kind: DeviceKind, reference: DeviceKind) -> float:
    """How many times longer `kind` takes than `reference` for the same work.

    The ratio of peak throughputs: a Nano against a Xavier NX is 1.69 / 0.472.
    """
    return reference.tflops / kind.tflops


def cluster_for(
    env: str,
    bandwidth_bps: float,
    profile_key: str,
    memory_scale: float = 1.0,
    reference: str = "Xavier NX",
) -> ClusterSpec:
    """The cluster of environment `env` with every pair linked at `bandwidth_bps`.

    Devices are named by kind and index ("nx-0", "tx2-1", "nano-2"), all
    described by the profile `profile_key` taken on the `reference` kind and
    slowed by `slowdown`. `memory_scale` multiplies each device's memory, e.g.
    to leave room for the OS and framework, or to scale a model's footprint
    against the devices' instead of the other way round.

    Raises:
        ConfigError: Unknown environment or kind, or a non-positive bandwidth or
            memory scale.

    """
    if not bandwidth_bps > 0:
        raise ConfigError(f"bandwidth must be positive bits/s, got {bandwidth_bps}")
    if not memory_scale > 0:
        raise ConfigError(f"memory_scale must be positive, got {memory_scale}")
    ref = device_kind(reference)
    devices = [
        DeviceSpec(
            name=f"{kind.prefix}-{i}",
            memory_bytes=max(1, int(_memory_in(env, kind) * memory_scale)),
            profile=profile_key,
            slowdown=slowdown(kind, ref),
        )
        for kind, count in environment(env)
        for i in range(count)
    ]
    return ClusterSpec(devices=devices, bandwidth=bandwidth_bps / 8)
