"""Shared figures of the split-device benchmark (`tests.bench.bench_duanwu_split`)."""

from __future__ import annotations

from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # name: zoo spec and the micro-batch (samples)
    "mobilenet_v2": {"spec": {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}, "micro": 8},
    "resnet18": {"spec": {"name": "resnet18"}, "micro": 8},
}
VARIANTS = ("plain", "split", "planner")
"""The epoch runs of one plan: no forward_share; every device at its optimal beta; the
optimal beta only on the devices where the split's measured gain clears the planner's margin."""
DEVICES = 4
DEVICE_CORES = "0-1"
"""Each emulated device's cpuset: both of this machine's cores, so its lanes can be pinned."""
DEVICE_CPU = 0.5
"""Each device's CPU quota in cores (the four sum to the machine's two)."""
DEVICE_MEMORY = 1 << 30
LINK_BPS = 1e9
SUBNET = "10.86.0.0/24"
"""No other testbed bench's subnet: they may share a machine."""
GLOBAL_BATCH = 64
EPOCH_SAMPLES = 50_000
"""The stated epoch: CIFAR-10's training set (both models take 32x32 images)."""
PAPER_PCT_SHORTER = {"AlexNet": 5.7, "GoogLeNet": 7.3}
"""Their Fig. 5 at depth 4: how much shorter a split epoch is (simulated), %."""


def fmt(x: float | None, spec: str = ".1f") -> str:
    """`x` formatted, a dash for a missing figure."""
    return "—" if x is None else format(x, spec)


def pct_shorter(new: float | None, old: float | None) -> str:
    """How much shorter `new` is than `old`, in % (negative: longer)."""
    if new is None or not old:
        return "—"
    return f"{(old - new) / old * 100:+.1f} %"
