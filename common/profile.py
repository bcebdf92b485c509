"""Profiles and cluster specs: what the planner knows about layers and devices.

A `Profile` is one model measured on one device: per-layer forward and
backward time at several batch sizes (time is not linear in batch size, so
the planner interpolates), the bytes a layer sends downstream, keeps for
backward, and holds as parameters and optimizer state. A `ClusterSpec` lists
the devices (memory budget, which profile describes them, a speed factor for
emulated devices) and the bandwidth between them.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from common.errors import ConfigError
from common.units import Bytes, BytesPerSecond

if TYPE_CHECKING:
    from common.store import Store

__all__ = ["ClusterSpec", "DeviceSpec", "LayerProfile", "Profile", "interp", "load_profiles"]


class LayerProfile(BaseModel):
    """Measurements of one layer on one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    name: str = ""
    forward_s: list[float] = Field(description="Median forward seconds per batch size.")
    backward_s: list[float] = Field(description="Median backward seconds per batch size.")
    output_bytes: int = Field(ge=0, description="Bytes of this layer's output, per sample.")
    activation_bytes: int = Field(
        ge=0, description="Memory kept for backward between F and B, per sample."
    )
    param_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0, description="Optimizer state bytes (e.g. momentum).")


class Profile(BaseModel):
    """One model on one device: per-layer costs at each of `batch_sizes`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Model key (zoo name plus options).")
    device: str = Field(description="Device fingerprint the profile was taken on.")
    batch_sizes: list[int] = Field(min_length=1)
    input_bytes: int = Field(0, ge=0, description="Bytes of one input sample.")
    memory_budget: int = Field(0, ge=0, description="Bytes the device may use (0: unknown).")
    layers: list[LayerProfile] = Field(min_length=1)
    created: float = 0.0
    split_gain: float | None = Field(
        None,
        ge=-1,
        description="Measured gain of Duan & Wu's split on this device: a forward+backward "
        "pair in turn over the pair on two lanes, minus one (None: not measured).",
    )

    @model_validator(mode="after")
    def _shapes(self) -> Profile:
        if sorted(set(self.batch_sizes)) != self.batch_sizes:
            raise ValueError("batch_sizes must be strictly increasing")
        for layer in self.layers:
            if len(layer.forward_s) != len(self.batch_sizes) or len(layer.backward_s) != len(
                self.batch_sizes
            ):
                raise ValueError(f"layer {layer.index} has times for a different batch list")
        return self

    def time(self, layer: int, batch: int, kind: str) -> float:
        """Seconds of forward ("F") or backward ("B") of `layer` on `batch` samples."""
        lp = self.layers[layer]
        return interp(self.batch_sizes, lp.forward_s if kind == "F" else lp.backward_s, batch)


def interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through the measured points, linear extrapolation beyond.

    Below the smallest batch size the time shrinks proportionally to the
    batch toward zero (a zero-sample batch costs nothing).
    """
    if x <= 0:
        return 0.0
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class DeviceSpec(BaseModel):
    """One device of the cluster as the planner sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    memory_bytes: Bytes = Field(
        gt=0, description="Memory budget for training on this device (4GiB, 512MB, bytes)."
    )
    profile: str = Field(
        "",
        description="The device's speed: a device kind, `here`, or a profiled fingerprint "
        "(`asteroid plan --list-profiles`).",
    )
    slowdown: float = Field(
        1.0, gt=0, description="Multiplier on the profile's times (emulated slower devices)."
    )


class ClusterSpec(BaseModel):
    """Devices and the bandwidth between them (bytes/s); latency per message in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: list[DeviceSpec] = Field(min_length=1)
    bandwidth: BytesPerSecond = Field(
        12.5e6, gt=0, description="Default link bandwidth (bytes/s, or like 12.5MB/s)."
    )
    links: dict[str, BytesPerSecond] = Field(
        default_factory=dict, description='Per-pair bandwidth, key "a|b" (symmetric).'
    )
    latency_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names repeat: {names}")
        return self

    def device(self, name: str) -> DeviceSpec:
        """The device called `name`."""
        for d in self.devices:
            if d.name == name:
                return d
        raise ConfigError(f"device {name} is not in the cluster ({[d.name for d in self.devices]})")

    def bw(self, a: str, b: str) -> float:
        """Bandwidth between devices `a` and `b` in bytes/s."""
        if a == b:
            return float("inf")
        return self.links.get(f"{a}|{b}", self.links.get(f"{b}|{a}", self.bandwidth))


def load_profiles(store: Store, keys: list[str]) -> dict[str, Profile]:
    """Profiles stored under `profile:<key>`; ConfigError names a missing or bad one."""
    out = {}
    for key in keys:
        data = store.get_json("profile", key)
        if data is None:
            raise ConfigError(f"no profile {key!r} in Redis: run asteroid-profiler first")
        try:
            out[key] = Profile.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"profile {key!r} in Redis is invalid: {exc}") from exc
    return out
