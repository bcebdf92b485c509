"""The inventory: the devices a cluster is deployed to, read from YAML.

Strict (unknown keys refused) because a typo in an ssh port or a role must
stop the deploy before any device is touched; a bad file fails with one line
naming the device and the field.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from common.curve import NAME_PATTERN
from common.errors import ConfigError, validation_message

__all__ = [
    "MAX_DEVICES",
    "Arch",
    "Device",
    "Inventory",
    "Role",
    "load_inventory",
    "parse_inventory",
]

MAX_DEVICES = 256
"""Most devices one inventory may name: far beyond an edge cluster, small enough to plan."""

Role = Literal["control", "worker"]
Arch = Literal["amd64", "arm64"]
"""Image architectures `make images ARCH=...` builds."""

_CLUSTER = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,252}$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_REGISTRY = re.compile(r"^[a-z0-9][a-z0-9.-]*(:[0-9]{1,5})?(/[a-z0-9._-]+)*$")
_DEVICE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")

Port = Annotated[int, Field(ge=1, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class Device(_Strict):
    """One device: how to reach it over ssh, what it runs, and what it may use."""

    name: str = Field(description="Device name: its worker's key name and container names.")
    host: str = Field(description="Address or host name ssh reaches the device at.")
    ssh_user: str = Field("root", description="User ssh logs in as (must be able to run docker).")
    ssh_port: Port = Field(22, description="Port of the device's sshd.")
    ssh_identity: Path | None = Field(
        None, description="Private key file for ssh (default: ssh's)."
    )
    arch: Arch | None = Field(
        None,
        description="CPU architecture of the device's images, amd64 or arm64 (default: the "
        "deploy asks the device, `uname -m`; given, it must agree).",
    )
    roles: tuple[Role, ...] = Field(
        description="control (Redis, coordinator, planner), worker (worker, profiler), or both."
    )
    memory: ByteSize = Field(
        description="Memory limit of the device's worker and profiler containers "
        "(the worker budgets training within it)."
    )
    cpus: float = Field(gt=0, le=1024, description="CPU limit of each of the device's containers.")
    threads: int = Field(
        0, ge=0, le=1024, description="Torch threads of its worker (0: the worker's default)."
    )
    data_port: Port = Field(5556, description="Worker data-plane port (open it to the peers).")
    link_port: Port = Field(5557, description="Worker bandwidth-probe port (open it too).")
    advertise_host: str = Field(
        "", description="Address peers reach the worker at (empty: the worker finds it)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value) or not NAME_PATTERN.fullmatch(value):
            raise ValueError("must be 1-32 of a-z, 0-9 and '-', starting with a letter or digit")
        return value

    @field_validator("host", "advertise_host")
    @classmethod
    def _host(cls, value: str, info: Any) -> str:
        if value == "" and info.field_name == "advertise_host":
            return value
        if not _HOST.fullmatch(value) or value.startswith("-"):
            raise ValueError(f"{value!r} is not a host name or address")
        return value

    @field_validator("ssh_identity")
    @classmethod
    def _identity(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @field_validator("ssh_user")
    @classmethod
    def _user(cls, value: str) -> str:
        if not _USER.fullmatch(value):
            raise ValueError(f"{value!r} is not a user name")
        return value

    @field_validator("roles", mode="before")
    @classmethod
    def _roles(cls, value: object) -> object:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list | tuple):
            if not items:
                raise ValueError("needs at least one of control, worker")
            if len(set(items)) != len(items):
                raise ValueError("names a role twice")
            return tuple(sorted(items))
        return value

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: ByteSize) -> ByteSize:
        if value < 64 << 20:
            raise ValueError(f"{value.human_readable()} is below the 64 MiB a worker needs")
        return value


class Inventory(_Strict):
    """A cluster: its name, where devices find its coordinator, and its devices."""

    cluster: str = Field(description="Cluster name: Redis key prefix and container names.")
    coordinator_host: str = Field(
        description="Address every device reaches the control device's coordinator and Redis at."
    )
    coordinator_port: Port = Field(5555, description="Coordinator control-plane port.")
    redis_port: Port = Field(6379, description="Redis port on the control device.")
    registry: str | None = Field(
        None,
        description="Registry (host[:port][/path]) to push images to and devices to pull "
        "from; without one, images are copied over ssh (docker save | docker load).",
    )
    remote_dir: str = Field(
        "/var/lib/asteroid-edge",
        description="Directory on each device for its keys and settings (a folder per "
        "cluster and device below it).",
    )
    known_hosts: Path | None = Field(
        None, description="known_hosts file with the devices' host keys (default: ssh's)."
    )
    devices: tuple[Device, ...] = Field(min_length=1, max_length=MAX_DEVICES)

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: str) -> str:
        if not _CLUSTER.fullmatch(value):
            raise ValueError("must be 1-32 of a-z, 0-9 and '-', starting with a letter or digit")
        return value

    @field_validator("coordinator_host")
    @classmethod
    def _coordinator(cls, value: str) -> str:
        if not _HOST.fullmatch(value) or value.startswith("-"):
            raise ValueError(f"{value!r} is not a host name or address")
        return value

    @field_validator("registry")
    @classmethod
    def _registry(cls, value: str | None) -> str | None:
        if value is not None and not _REGISTRY.fullmatch(value):
            raise ValueError(f"{value!r} is not a registry (host[:port][/path], lower case)")
        return value

    @field_validator("remote_dir")
    @classmethod
    def _remote_dir(cls, value: str) -> str:
        path = PurePosixPath(value)
        if (
            not path.is_absolute()
            or ".." in path.parts
            or not re.fullmatch(r"[A-Za-z0-9/._-]+", value)
        ):
            raise ValueError(f"{value!r} must be an absolute path of letters, digits, / . _ -")
        return str(path)

    @field_validator("known_hosts")
    @classmethod
    def _known_hosts(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @model_validator(mode="after")
    def _one_control(self) -> Inventory:
        names = [d.name for d in self.devices]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"device names must be unique, {', '.join(twice)} repeat")
        control = [d.name for d in self.devices if "control" in d.roles]
        if len(control) != 1:
            raise ValueError(f"exactly one device must have role control, found {control or 0}")
        if not any("worker" in d.roles for d in self.devices):
            raise ValueError("no device has role worker")
        return self

    @property
    def control(self) -> Device:
        """The device running Redis, the coordinator and the planner."""
        return next(d for d in self.devices if "control" in d.roles)

    def with_arches(self, arches: Mapping[str, Arch]) -> Inventory:
        """A copy with each named device's architecture set (as learned from the device)."""
        devices = tuple(
            d.model_copy(update={"arch": arches[d.name]}) if d.name in arches else d
            for d in self.devices
        )
        return self.model_copy(update={"devices": devices})

    def device(self, name: str) -> Device:
        """The device called `name`, else ConfigError."""
        for d in self.devices:
            if d.name == name:
                return d
        raise ConfigError(f"no device {name!r} in the inventory")

    @property
    def coordinator(self) -> str:
        """The coordinator's control-plane address as devices use it."""
        return f"tcp://{_bracket(self.coordinator_host)}:{self.coordinator_port}"


def _bracket(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def _where(data: Any, loc: tuple[int | str, ...]) -> str:
    """The place of an error: "device NAME: field" inside a device, else the dotted path."""
    if len(loc) >= 2 and loc[0] == "devices" and isinstance(loc[1], int):
        name: Any = None
        devices = data.get("devices") if isinstance(data, dict) else None
        if (
            isinstance(devices, list)
            and loc[1] < len(devices)
            and isinstance(devices[loc[1]], dict)
        ):
            name = devices[loc[1]].get("name")
        who = f"device {name}" if isinstance(name, str) else f"device #{loc[1] + 1}"
        rest = ".".join(str(p) for p in loc[2:])
        return f"{who}: {rest}" if rest else who
    return ".".join(str(p) for p in loc) or "inventory"


def _message(exc: ValidationError, data: Any) -> str:
    return validation_message(exc, lambda loc: _where(data, loc), Inventory)


def parse_inventory(data: Any, source: str = "inventory") -> Inventory:
    """Validate already-loaded inventory data; ConfigError names the device and field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return Inventory.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_message(exc, data)}") from exc


def load_inventory(path: Path) -> Inventory:
    """Read an inventory file (YAML), with a one-line error naming the file, device and field."""
    try:
        text = path.read_text()
        if len(text) > 1 << 20:
            raise ConfigError(f"inventory {path}: larger than 1 MiB")
        data = yaml.safe_load(text)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read inventory {path}: {' '.join(str(exc).split())}") from exc
    return parse_inventory(data, f"inventory {path}")
