"""Edge devices and environments from the papers, as data the planners can run on.

Asteroid (MobiCom'24) evaluates on Jetson Nano, TX2 and Xavier NX boards grouped
into four environments (its §6) over 100 Mbps and 1 Gbps links; Galaxy
(INFOCOM'24) emulates heterogeneity with Jetson Nanos clocked at different
levels. We have one kind of CPU core, not these boards, so a device is the
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
    "JETSON_NANO",
    "JETSON_NANO_50",
    "JETSON_NANO_75",
    "JETSON_TX2",
    "JETSON_XAVIER_NX",
    "LINK_SPEEDS_BPS",
    "DeviceKind",
    "cluster_for",
    "device_kind",
    "environment",
    "slowdown",
]

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceKind:
    """A kind of edge device: its memory, peak compute and where the figures come from.

    Attributes:
        name: Human name, also the key of `DEVICE_KINDS`.
        memory_bytes: Physical memory (shared by CPU and GPU on a Jetson).
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

# Galaxy (Ye et al., INFOCOM'24) builds its heterogeneous edge environments from
# Jetson Nanos whose GPU clock is capped at different levels; we model them as
# Nanos at 100%, 75% and 50% of the full clock (slowdowns 1.0, 1.33 and 2.0
# relative to a full-clock Nano), with the Nano's memory.
_GALAXY = "Galaxy (INFOCOM'24) edge environments: Jetson Nano at reduced GPU clock"
JETSON_NANO_75 = DeviceKind("Jetson Nano @75%", 4 * GiB, 0.472 * 0.75, _GALAXY, "nano75")
JETSON_NANO_50 = DeviceKind("Jetson Nano @50%", 4 * GiB, 0.472 * 0.50, _GALAXY, "nano50")

DEVICE_KINDS: dict[str, DeviceKind] = {
    k.name: k for k in (JETSON_NANO, JETSON_TX2, JETSON_XAVIER_NX, JETSON_NANO_75, JETSON_NANO_50)
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

# Galaxy's heterogeneous environments, named apart from Asteroid's "D". The
# mix of clock levels per environment is ours (two, three and four Nanos
# covering the three levels), not copied from the paper's table.
GALAXY_ENVIRONMENTS: dict[str, tuple[tuple[str, int], ...]] = {
    "Galaxy-D": (("Jetson Nano", 1), ("Jetson Nano @75%", 1)),
    "Galaxy-E": (("Jetson Nano", 1), ("Jetson Nano @75%", 1), ("Jetson Nano @50%", 1)),
    "Galaxy-F": (("Jetson Nano", 2), ("Jetson Nano @75%", 1), ("Jetson Nano @50%", 1)),
}
"""Galaxy-style environments: Jetson Nanos at three clock levels."""

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
            memory_bytes=max(1, int(kind.memory_bytes * memory_scale)),
            profile=profile_key,
            slowdown=slowdown(kind, ref),
        )
        for kind, count in environment(env)
        for i in range(count)
    ]
    return ClusterSpec(devices=devices, bandwidth=bandwidth_bps / 8)
