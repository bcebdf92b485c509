"""The pure core of a deploy: desired state and reports in, a list of actions out.

Only what differs is touched: an image is shipped only when the device lacks
its id, a file is written only when its SHA-256 differs, and a container is
replaced only when its config hash differs (and started when it is merely
stopped). So a second deploy of an unchanged inventory plans no action, which
is what makes `asteroid deploy up` safe to repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.deploy.desired import ContainerSpec, DesiredDevice
from services.deploy.observe import DeviceReport

__all__ = ["Action", "ServiceStatus", "plan_down", "plan_up", "status_rows"]

Kind = Literal[
    "ship-image",
    "write-file",
    "remove-file",
    "remove-container",
    "start-container",
    "run-container",
    "remove-volume",
    "remove-image",
    "remove-dir",
]


@dataclass(frozen=True)
class Action:
    """One change on one device; `str()` is what the deploy prints for it."""

    device: str
    kind: Kind
    target: str
    """Image reference, file path, container or volume name, or directory."""
    image_id: str = ""
    container: ContainerSpec | None = None

    def __str__(self) -> str:
        """E.g. "w1: run-container asteroid-lab-w1-worker"."""
        return f"{self.device}: {self.kind} {self.target}"


def plan_up(want: DesiredDevice, have: DeviceReport) -> list[Action]:
    """The actions that bring one device from `have` to `want`, in the order to run them."""
    dev = want.device.name
    actions: list[Action] = []
    ids = have.image_ids()
    shipped: set[str] = set()
    for c in want.containers:
        if c.image_id not in ids and c.image not in shipped:
            shipped.add(c.image)
            actions.append(Action(dev, "ship-image", c.image, image_id=c.image_id))
    for path, spec in sorted(want.files.items()):
        if have.files.get(path) != spec.digest:
            actions.append(Action(dev, "write-file", path))
    for path in sorted(have.files.keys() - want.files.keys()):
        actions.append(Action(dev, "remove-file", path))
    wanted = {c.name: c for c in want.containers}
    for name in sorted(have.containers.keys() - wanted.keys()):
        actions.append(Action(dev, "remove-container", name))
    for c in want.containers:
        seen = have.containers.get(c.name)
        if seen is not None and seen.config != c.config:
            actions.append(Action(dev, "remove-container", c.name))
            actions.append(Action(dev, "run-container", c.name, container=c))
        elif seen is None:
            actions.append(Action(dev, "run-container", c.name, container=c))
        elif seen.state not in ("running", "restarting"):
            actions.append(Action(dev, "start-container", c.name))
    return actions


def plan_down(want: DesiredDevice, have: DeviceReport) -> list[Action]:
    """Remove our containers, volumes and folder from a device, and the images we shipped.

    An image is removed only when a deploy recorded shipping it and the device
    still has it under that id: an image that was there before stays.
    """
    dev = want.device.name
    actions = [Action(dev, "remove-container", name) for name in sorted(have.containers)]
    actions += [Action(dev, "remove-volume", v) for v in sorted(have.volumes)]
    for ref, image_id in sorted(have.shipped.items()):
        if have.images.get(ref) == image_id:
            actions.append(Action(dev, "remove-image", ref, image_id=image_id))
    if have.files or have.shipped:
        actions.append(Action(dev, "remove-dir", want.directory))
    return actions


@dataclass(frozen=True)
class ServiceStatus:
    """One row of `asteroid deploy status`."""

    device: str
    service: str
    state: str
    health: str
    version: str
    current: bool
    """Whether the container runs the config this inventory would deploy."""


def status_rows(want: DesiredDevice, have: DeviceReport) -> list[ServiceStatus]:
    """Per service of the device: state, health and version (missing when not there)."""
    rows = []
    for c in want.containers:
        seen = have.containers.get(c.name)
        if seen is None:
            rows.append(ServiceStatus(want.device.name, c.service, "missing", "-", "-", False))
        else:
            rows.append(
                ServiceStatus(
                    want.device.name,
                    c.service,
                    seen.state,
                    seen.health,
                    seen.version or "-",
                    seen.config == c.config,
                )
            )
    return rows
