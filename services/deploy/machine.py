"""Which image architecture a device runs, from what the device says it is.

One inventory may hold a laptop (amd64) beside Raspberry Pis and Jetsons
(arm64); the deploy asks each device (`uname -m`, and its Docker engine's
architecture) before it picks images, so nobody has to get `arch:` right by
hand. The engine is asked too because a 64-bit kernel under a 32-bit OS (a
Raspberry Pi OS image from before its 64-bit release) reports ``aarch64`` while
its Docker engine runs only 32-bit ``arm`` images. An `arch` the inventory
states is checked against the device, never trusted over it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import ConfigError
from services.deploy.inventory import Arch, Device
from services.deploy.observe import ProbeError

__all__ = ["ENGINE_ARCH", "KERNEL_ARCH", "MACHINE_SCRIPT", "Machine", "image_arch", "parse_machine"]

MACHINE_SCRIPT = "uname -m; docker version --format '{{.Server.Arch}}' 2>/dev/null || echo -"
"""Prints the kernel's machine name, then the engine's architecture ("-": no engine answers)."""

KERNEL_ARCH: dict[str, Arch] = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64"}
"""`uname -m` of the machines the images are built for."""
ENGINE_ARCH: dict[str, Arch] = {"amd64": "amd64", "arm64": "arm64"}
"""Docker's `Server.Arch` (Go's GOARCH) of the same."""
_WORD = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


@dataclass(frozen=True)
class Machine:
    """What a device says about its processor: the kernel's and the engine's view."""

    kernel: str
    """`uname -m`: x86_64, aarch64, armv7l, ..."""
    engine: str
    """The Docker engine's architecture (amd64, arm64, arm, ...), "-" when none answers."""


def parse_machine(device: str, text: str) -> Machine:
    """The two lines of `MACHINE_SCRIPT`'s output; ProbeError naming the device otherwise."""
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) != 2 or not all(_WORD.match(line) or line == "-" for line in lines):
        raise ProbeError(f"device {device}: unexpected answer to `uname -m`: {text[:120]!r}")
    return Machine(kernel=lines[0], engine=lines[1])


def image_arch(dev: Device, machine: Machine) -> Arch:
    """The architecture of the images `dev` runs; ConfigError saying what to change.

    Pure, so every case (an unsupported board, a 32-bit OS, an inventory that
    disagrees with the device) is tested without one.
    """
    arch = KERNEL_ARCH.get(machine.kernel)
    if arch is None:
        raise ConfigError(
            f"device {dev.name} is {machine.kernel} (uname -m): the images are built for "
            "x86_64 (amd64) and aarch64 (arm64); on a Raspberry Pi, install a 64-bit OS"
        )
    if machine.engine == "-":
        raise ConfigError(
            f"device {dev.name}: no Docker engine answers `docker version` for ssh user "
            f"{dev.ssh_user} (install docker.io and add the user to the docker group)"
        )
    if ENGINE_ARCH.get(machine.engine) != arch:
        raise ConfigError(
            f"device {dev.name} has a {machine.kernel} kernel but its Docker engine runs "
            f"{machine.engine} images (a 32-bit OS on a 64-bit kernel): install the "
            f"64-bit ({arch}) OS and Docker"
        )
    if dev.arch is not None and dev.arch != arch:
        raise ConfigError(
            f"device {dev.name} is {arch} ({machine.kernel}), but the inventory says "
            f"arch: {dev.arch} (correct it, or leave it out and the deploy asks the device)"
        )
    return arch
