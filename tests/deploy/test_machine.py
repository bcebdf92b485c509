"""Each device's images are of the architecture the device reports, in one mixed inventory.

The pure choice (`image_arch`) is tested for every case a person meets: a
laptop, a Pi or Jetson with a 64-bit OS, a 32-bit OS on a 64-bit kernel, a
32-bit board, no Docker engine, and an inventory that disagrees with the
device. A `Deployment` whose devices answer through a stand-in for ssh shows
the learned architectures picking per-device images and being asked once per
device; the last test asks emulated devices over a real sshd.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from services.deploy.apply import Deployment
from services.deploy.desired import desired_state, needed_images
from services.deploy.inventory import Device, parse_inventory
from services.deploy.machine import (
    KERNEL_ARCH,
    MACHINE_SCRIPT,
    Machine,
    image_arch,
    parse_machine,
)
from services.deploy.observe import ProbeError
from tests.deploy.fixtures import ACL, VERSION, image_ids, inventory, key_set
from tests.deploy.sshdevices import SshDevices


def device(arch: str | None = None) -> Device:
    data: dict[str, Any] = {
        "name": "pi-1",
        "host": "10.0.0.9",
        "roles": ["worker"],
        "memory": "1GiB",
        "cpus": 4,
    }
    if arch is not None:
        data["arch"] = arch
    return Device.model_validate(data)


@pytest.mark.parametrize(
    ("kernel", "engine", "stated", "expect"),
    [
        ("x86_64", "amd64", None, "amd64"),
        ("aarch64", "arm64", None, "arm64"),
        ("aarch64", "arm64", "arm64", "arm64"),
        ("x86_64", "amd64", "amd64", "amd64"),
    ],
)
def test_the_device_s_answer_picks_its_images(
    kernel: str, engine: str, stated: str | None, expect: str
) -> None:
    assert image_arch(device(stated), Machine(kernel, engine)) == expect


@pytest.mark.parametrize(
    ("kernel", "engine", "stated", "message"),
    [
        ("armv7l", "arm", None, r"pi-1 is armv7l .*install a 64-bit OS"),
        ("aarch64", "arm", None, r"aarch64 kernel but its Docker engine runs arm images"),
        ("aarch64", "-", None, r"no Docker engine answers"),
        ("aarch64", "arm64", "amd64", r"pi-1 is arm64 \(aarch64\), but the inventory says"),
        ("x86_64", "amd64", "arm64", r"pi-1 is amd64 \(x86_64\), but the inventory says"),
        ("riscv64", "riscv64", None, r"pi-1 is riscv64"),
    ],
)
def test_what_cannot_run_the_images_is_refused_saying_what_to_change(
    kernel: str, engine: str, stated: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        image_arch(device(stated), Machine(kernel, engine))


def test_the_answer_is_read_strictly() -> None:
    assert parse_machine("pi-1", "aarch64\narm64\n") == Machine("aarch64", "arm64")
    assert parse_machine("pi-1", "x86_64\n-\n") == Machine("x86_64", "-")
    for text in ("", "aarch64\n", "aarch64\narm64\nextra\n", "aarch64; rm -rf /\narm64\n"):
        with pytest.raises(ProbeError, match="device pi-1: unexpected answer"):
            parse_machine("pi-1", text)


def test_the_script_asks_the_kernel_and_the_engine() -> None:
    assert MACHINE_SCRIPT.startswith("uname -m;")
    assert "{{.Server.Arch}}" in MACHINE_SCRIPT


class Answering(Deployment):
    """A deployment whose devices answer `MACHINE_SCRIPT` from a table, counting the asks."""

    answers: dict[str, str]
    asked: list[str]

    def machine(self, dev: Device) -> Machine:
        self.asked.append(dev.name)
        return parse_machine(dev.name, self.answers[dev.name])


def answering(tmp_path: Path, answers: dict[str, str]) -> Answering:
    deployment = Answering(inventory(), tmp_path / "keys", VERSION, ACL.read_text())
    deployment.answers, deployment.asked = answers, []
    return deployment


def test_one_inventory_holds_amd64_and_arm64_devices(tmp_path: Path) -> None:
    answers = {"ctl": "x86_64\namd64\n", "w1": "aarch64\narm64\n", "w2": "x86_64\namd64\n"}
    deployment = answering(tmp_path, answers)
    assert deployment.arches() == {"ctl": "amd64", "w1": "arm64", "w2": "amd64"}
    assert deployment.needed() == {
        f"asteroid-edge/control:{VERSION}",
        f"asteroid-edge/redis:{VERSION}",
        f"asteroid-edge/worker:{VERSION}",
        f"asteroid-edge/worker:{VERSION}-arm64",
    }
    key_set(tmp_path / "keys")
    ids = image_ids(deployment.resolved())
    want = {w.device.name: w for w in deployment.desired(ids)}
    assert {c.image for c in want["w1"].containers} == {f"asteroid-edge/worker:{VERSION}-arm64"}
    assert {c.image for c in want["w2"].containers} == {f"asteroid-edge/worker:{VERSION}"}
    assert {c.image_id for c in want["w1"].containers} == {
        ids[f"asteroid-edge/worker:{VERSION}-arm64"]
    }
    assert sorted(deployment.asked) == ["ctl", "w1", "w2"]  # once each, however often used


def test_a_device_that_cannot_run_the_images_stops_the_deploy_before_any_change(
    tmp_path: Path,
) -> None:
    answers = {"ctl": "x86_64\namd64\n", "w1": "armv7l\narm\n", "w2": "x86_64\namd64\n"}
    with pytest.raises(ConfigError, match="device w1 is armv7l"):
        answering(tmp_path, answers).needed()


def test_unknown_architectures_pick_no_image(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device ctl: its architecture is not known"):
        needed_images(inventory(), VERSION)
    with pytest.raises(ConfigError, match="architecture is not known"):
        desired_state(inventory(), key_set(tmp_path), ACL.read_text(), {}, VERSION)


@pytest.mark.integration
@pytest.mark.parametrize("devices", [["d1", "d2"]], indirect=True)
def test_devices_are_asked_over_ssh(engine: None, devices: SshDevices, tmp_path: Path) -> None:
    """The emulated devices are this machine, so they answer what this machine is."""
    kernel = os.uname().machine
    arch = KERNEL_ARCH[kernel]
    other = "arm64" if arch == "amd64" else "amd64"
    specs = [
        {
            "name": name,
            "host": devices.addresses[name],
            "ssh_identity": str(devices.client_key),
            "roles": roles,
            "memory": "256MiB",
            "cpus": 1,
        }
        for name, roles in (("d1", ["control"]), ("d2", ["worker"]))
    ]
    data = {
        "cluster": "arch",
        "coordinator_host": devices.bridge_ip,
        "known_hosts": str(devices.known_hosts),
        "devices": specs,
    }
    inv = parse_inventory(data)
    machine = Deployment(inv, tmp_path, VERSION, "").machine(inv.device("d2"))
    assert machine == Machine(kernel, arch)
    assert Deployment(inv, tmp_path, VERSION, "").arches() == {"d1": arch, "d2": arch}
    specs[1]["arch"] = other
    wrong = parse_inventory(data)
    with pytest.raises(ConfigError, match=rf"device d2 is {arch} \({kernel}\), but the inventory"):
        Deployment(wrong, tmp_path, VERSION, "").arches()
