"""What a testbed emulates: devices with a CPU share, a memory limit and a shaped link.

Presets turn the papers' environments (`services.testbed.presets`, the one source of the
kinds and their mixes) into devices this machine can host:

- CPU: each device gets cores in proportion to its kind's peak TFLOPS (the
  ratios Asteroid's Table 1 implies; `services.testbed.presets.slowdown`), scaled per
  preset so that the quotas sum to at most `CPU_BUDGET` = 1.6 of the machine's
  two cores (the rest runs Redis, the coordinator, the planner and the
  kernel's share of the network, so measured speeds are not contention
  artefacts) and no device gets more than `MAX_DEVICE_CPU` = 0.5 cores (one
  device is never most of the machine). Rounded down to 1/1000 core: Env A
  5 Nanos at 0.32; Env B NX 0.349, TX2 0.275; Env C NX 0.468, TX2 0.369,
  Nano 0.13; Env D TX2 0.5, Nano 0.177; Galaxy's Nano-L / Nano-M / Nano-S
  (CPU at 1.47 GHz / 825 MHz / 403 MHz) 0.5 / 0.28 / 0.137 in D-F, Nano-M
  0.5 each in A and B, 0.4 in C.
- Memory: the kind's memory times `MEMORY_SCALE` = 1/8 (Nano 4 GiB -> 512 MiB,
  TX2 and Xavier NX 8 GiB -> 1 GiB), never below `MEMORY_FLOOR` = 384 MiB.
  Galaxy's devices get 320 MiB for the worker plus their budget (1.5 / 1.2 /
  0.7 GiB) times 1/8: 512 / 473.6 / 473.6 MiB.
  Measured in a memory cgroup (torch 2.13, x86-64, one thread): an idle worker
  (Python, torch, ZeroMQ) is charged about 240 MiB, training small_cnn at batch
  8 about 265 MiB, mobilenet_v2 whole at batch 8 with Adam about 470 MiB. So
  mobilenet_v2 trains on one TX2/NX-sized device and, split by the planner,
  across Nano-sized ones; 1/16 would leave a Nano 256 MiB, less than a worker
  needs to start.
- Link: every device's link runs at the preset's rate (Asteroid evaluates at
  100 Mbps and 1 Gbps, `services.testbed.presets.LINK_SPEEDS_BPS`) with 0.5 ms latency
  each way, a switched LAN's order of magnitude.

`cluster_spec` is the planner's view of the same testbed: a transfer from a to
b crosses a's shaped uplink and b's shaped downlink, so it runs at the slower
of the two, and the training memory is what the limit leaves after an idle
worker's footprint (`WORKER_BASELINE_BYTES`).
"""

from __future__ import annotations

import ipaddress
import os
import re
from itertools import combinations
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.errors import ConfigError
from common.profile import ClusterSpec, DeviceSpec
from common.spec_files import load_spec_file
from services.testbed.presets import GALAXY_ENVIRONMENTS, environment, galaxy_devices

__all__ = [
    "CPU_BUDGET",
    "FIRST_DEVICE_HOST",
    "MAX_DEVICES",
    "MAX_DEVICE_CPU",
    "MEMORY_FLOOR",
    "MEMORY_SCALE",
    "PRESETS",
    "WORKER_BASELINE_BYTES",
    "TestbedDevice",
    "TestbedSpec",
    "cluster_spec",
    "load_testbed",
    "parse_bytes",
    "parse_cpus",
    "parse_rate",
    "preset",
]

MiB = 1 << 20

CPU_BUDGET = 1.6
"""Most cores a preset's devices get together (of the machine's two)."""

MAX_DEVICE_CPU = 0.5
"""Most cores one preset device gets."""

MEMORY_SCALE = 1 / 8
"""A preset device's memory limit as a fraction of its kind's memory."""

MEMORY_FLOOR = 384 * MiB
"""Smallest preset memory limit: an idle worker plus room to train a small model."""

WORKER_BASELINE_BYTES = 256 * MiB
"""An idle worker's footprint (measured ~240 MiB), left out of the planner's budget."""

MAX_DEVICES = 250
"""Most devices in one testbed."""

GALAXY_WORKER_BYTES = 320 << 20
"""Room for a worker (about 240 MiB idle, measured) under a Galaxy device's budget; at
least `MEMORY_FLOOR` with the smallest budget, so that every device can start."""

FIRST_DEVICE_HOST = 10
"""Device i gets the subnet's host number FIRST_DEVICE_HOST + i; .1 is the bridge."""

PRESETS: dict[str, str] = {
    "env-a": "A",
    "env-b": "B",
    "env-c": "C",
    "env-d": "D",
    "galaxy-a": "Galaxy-A",
    "galaxy-b": "Galaxy-B",
    "galaxy-c": "Galaxy-C",
    "galaxy-d": "Galaxy-D",
    "galaxy-e": "Galaxy-E",
    "galaxy-f": "Galaxy-F",
}
"""Preset name -> environment of `services.testbed.presets`."""

_NAME = r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$"
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_rate(value: str | float) -> float:
    """Bits per second from a number or tc-style text ("100mbit", "1gbit": powers of 1000)."""
    if not isinstance(value, str):
        return float(value)
    m = _RATE.match(value)
    if not m:
        raise ValueError(f"expected bits/s as a number or like '100mbit', got {value!r}")
    return float(m.group(1)) * 1000.0 ** _POWER[m.group(2).lower()]


def parse_cpus(value: str) -> frozenset[int]:
    """The cores of a kernel cpu list ("0-1,4"); ValueError for a reversed or empty range."""
    out: set[int] = set()
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"cpu range {part!r} runs backwards")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("no cores in the cpu list")
    return frozenset(out)


def parse_bytes(value: str | int) -> int:
    """Bytes from a number or text ("512MiB", "1GiB" are powers of 1024; "1GB" of 1000)."""
    if not isinstance(value, str):
        return int(value)
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"expected bytes as a number or like '512MiB', got {value!r}")
    base = 1024.0 if m.group(3) else 1000.0
    return int(float(m.group(1)) * base ** _POWER[m.group(2).lower()])


class TestbedDevice(BaseModel):
    """One emulated device: its share of this machine and its link."""

    __test__ = False  # not a pytest test class despite the name
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        pattern=_NAME,
        description="Device name (worker id, host name, namespace and cgroup suffix): "
        "lower-case letters, digits and inner dashes, at most 32.",
    )
    kind: str = Field("", description="What it emulates, e.g. 'Jetson Nano' (informational).")
    cpu: float = Field(ge=0.01, le=256, description="CPU quota in cores, e.g. 0.3.")
    cpus: str | None = Field(
        None,
        pattern=r"^\d{1,4}(-\d{1,4})?(,\d{1,4}(-\d{1,4})?){0,63}$",
        description="Cores of its own (a cpuset, e.g. '0-1'); none: any of the machine's. "
        "With two or more, Duan & Wu's forward and backward lanes each get their own.",
    )
    memory_bytes: int = Field(ge=64 * MiB, description="Memory limit of each of its processes.")
    bandwidth_bps: float = Field(ge=1e4, le=1e11, description="Link rate, bits/s, each way.")
    latency_ms: float = Field(0.5, ge=0, le=10_000, description="One-way link latency.")
    loss_pct: float = Field(0.0, ge=0, le=100, description="Packets lost on the link, percent.")

    @field_validator("cpus")
    @classmethod
    def _cores(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cpus(v)
        return v

    def cores(self) -> frozenset[int] | None:
        """The device's own cores, None where it has none."""
        return None if self.cpus is None else parse_cpus(self.cpus)

    @field_validator("bandwidth_bps", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> Any:
        return parse_rate(v) if isinstance(v, str) else v

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_bytes(v) if isinstance(v, str) else v


class TestbedSpec(BaseModel):
    """A named set of devices on one private subnet."""

    __test__ = False
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=_NAME, description="Testbed name (also the Redis cluster key).")
    subnet: str = Field(
        "10.77.0.0/24",
        description="Private IPv4 subnet used only inside this testbed's namespaces; "
        "the bridge takes the first address, device i the host number 10 + i.",
    )
    devices: list[TestbedDevice] = Field(min_length=1, max_length=MAX_DEVICES)

    @field_validator("subnet")
    @classmethod
    def _private(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError as exc:
            raise ValueError(f"not an IPv4 network like 10.77.0.0/24: {exc}") from None
        if not net.is_private or net.is_loopback or net.is_link_local:
            raise ValueError(f"{v} is not a private range (use e.g. 10.77.0.0/24)")
        return str(net)

    @model_validator(mode="after")
    def _fits(self) -> TestbedSpec:
        names = [d.name for d in self.devices]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"device names repeat: {repeated}")
        room = ipaddress.IPv4Network(self.subnet).num_addresses - 1 - FIRST_DEVICE_HOST
        if len(self.devices) > room:
            raise ValueError(
                f"subnet {self.subnet} has room for {max(room, 0)} devices, "
                f"the testbed has {len(self.devices)}"
            )
        return self

    def device(self, name: str) -> TestbedDevice:
        """The device called `name`; ConfigError lists the devices otherwise."""
        for d in self.devices:
            if d.name == name:
                return d
        raise ConfigError(f"no device {name!r} in testbed {self.name} ({self.names()})")

    def names(self) -> list[str]:
        """Device names in order."""
        return [d.name for d in self.devices]

    def index(self, name: str) -> int:
        """Position of device `name` (it sets the address and interface names)."""
        return self.names().index(self.device(name).name)

    def address(self, name: str) -> str:
        """IPv4 address of device `name`."""
        net = ipaddress.IPv4Network(self.subnet)
        return str(net.network_address + FIRST_DEVICE_HOST + self.index(name))

    def bridge_address(self) -> str:
        """The host side's address on the testbed subnet (where services listen)."""
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1)

    def warnings(self, cores: float | None = None) -> list[str]:
        """What may make results misleading without being wrong: oversubscribed CPU, tiny memory."""
        have = cores if cores is not None else float(len(os.sched_getaffinity(0)))
        out = []
        total = sum(d.cpu for d in self.devices)
        if total > have:
            out.append(
                f"the devices' CPU quotas sum to {total:.2f} cores, more than this machine's "
                f"{have:g}: they will slow each other down beyond their quotas"
            )
        machine = os.sched_getaffinity(0) if cores is None else set(range(int(have)))
        for d in self.devices:
            mine = d.cores()
            if mine is not None and not mine <= machine:
                out.append(
                    f"device {d.name} is given cores {sorted(mine - machine)} this machine "
                    f"does not offer: its cgroup cannot be made"
                )
            elif mine is not None and d.cpu > len(mine):
                out.append(
                    f"device {d.name} has a {d.cpu:g}-core quota on {len(mine)} cores: "
                    f"it can use at most {len(mine)}"
                )
        small = [d.name for d in self.devices if d.memory_bytes < MEMORY_FLOOR]
        if small:
            out.append(
                f"devices {small} have less than {MEMORY_FLOOR // MiB} MiB: a worker may not start"
            )
        return out


def load_testbed(path: Path) -> TestbedSpec:
    """Read a custom testbed from YAML, with an error naming the file and the field."""
    return load_spec_file(path, TestbedSpec, "testbed")


def preset(name: str, link: str = "1gbit") -> TestbedSpec:
    """The testbed of environment `name` ("env-a".."env-d", "galaxy-a".."galaxy-f").

    Every device's link runs at `link` ("100mbit", "1gbit" or any tc rate).

    Raises:
        ConfigError: Unknown preset or unreadable link rate.

    """
    env = PRESETS.get(name)
    if env is None:
        raise ConfigError(f"unknown testbed preset {name!r}; known: {', '.join(PRESETS)}")
    try:
        bps = parse_rate(link)
    except ValueError as exc:
        raise ConfigError(f"link: {exc}") from None
    kinds = environment(env)
    total = sum(k.tflops * n for k, n in kinds)
    fastest = max(k.tflops for k, _ in kinds)
    cores_per_tflops = min(MAX_DEVICE_CPU / fastest, CPU_BUDGET / total)
    memory = _galaxy_memory(env) if env in GALAXY_ENVIRONMENTS else {}
    devices = [
        TestbedDevice(
            name=f"{kind.prefix}-{i}",
            kind=kind.name,
            cpu=_round_down(kind.tflops * cores_per_tflops),
            memory_bytes=memory.get(
                f"{kind.prefix}-{i}", max(MEMORY_FLOOR, int(kind.memory_bytes * MEMORY_SCALE))
            ),
            bandwidth_bps=bps,
        )
        for kind, count in kinds
        for i in range(count)
    ]
    return TestbedSpec(name=name, devices=devices)


def _galaxy_memory(env: str) -> dict[str, int]:
    """Memory limits of a Galaxy environment's devices: a worker plus the scaled budget.

    Galaxy's budgets (1.5 / 1.2 / 0.7 GB, Nano-M 1.5 GB when alone) are what a
    device gives the model; scaled by `MEMORY_SCALE`, on top of what an idle
    worker is charged, so that the budgets the planner sees keep the paper's ratios.
    """
    return {d.name: GALAXY_WORKER_BYTES + d.budget_bytes for d in galaxy_devices(env, MEMORY_SCALE)}


def _round_down(cores: float) -> float:
    """Cores to a thousandth, rounded down so that a preset's sum stays within budget."""
    return int(cores * 1000 + 1e-9) / 1000


def cluster_spec(spec: TestbedSpec) -> ClusterSpec:
    """The cluster as the planner should see it.

    Each pair's bandwidth is the slower of the two links (bytes/s); the
    latency is the largest one-way sum of two links (one number for the whole
    cluster is all `ClusterSpec` holds); memory is the limit less an idle
    worker's footprint; slowdown is 1 because profiles are measured on the
    devices themselves, under their quotas.
    """
    devices = [
        DeviceSpec(
            name=d.name,
            memory_bytes=max(MiB, d.memory_bytes - WORKER_BASELINE_BYTES),
            profile="",
            slowdown=1.0,
        )
        for d in spec.devices
    ]
    links = {
        f"{a.name}|{b.name}": min(a.bandwidth_bps, b.bandwidth_bps) / 8
        for a, b in combinations(spec.devices, 2)
    }
    latency = max(
        ((a.latency_ms + b.latency_ms) / 1000 for a, b in combinations(spec.devices, 2)),
        default=0.0,
    )
    return ClusterSpec(
        devices=devices,
        bandwidth=min(d.bandwidth_bps for d in spec.devices) / 8,
        links=links,
        latency_s=latency,
    )
