"""Shipping an image over ssh (`docker save | ssh docker load`) and removing only what was shipped.

The devices' docker CLI reaches this machine's engine, so an image built here
is already "on" every device; this test ships a tiny image from an archive
instead (the save command is the one thing swapped), after removing it from
the engine, so the device really lacks it until the pipe over ssh loads it.
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

from services.deploy.apply import Deployment
from services.deploy.desired import ContainerSpec, DesiredDevice
from services.deploy.inventory import parse_inventory
from services.deploy.reconcile import plan_down, plan_up
from tests.deploy.sshdevices import SshDevices

pytestmark = pytest.mark.integration


def docker(*args: str, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert not check or out.returncode == 0, out.stderr
    return out.stdout.strip()


def tiny_image(ref: str, tmp_path: Path) -> str:
    """Import a one-file image as `ref`; its id."""
    (tmp_path / "hello").write_text("hello\n")
    rootfs = tmp_path / "rootfs.tar"
    with tarfile.open(rootfs, "w") as tar:
        tar.add(tmp_path / "hello", arcname="hello")
    docker("import", str(rootfs), ref)
    return docker("image", "inspect", "--format", "{{.Id}}", ref)


@pytest.mark.parametrize("devices", [["d1"]], indirect=True)
def test_an_image_the_device_lacks_is_shipped_recorded_and_removed_on_undeploy(
    engine: None, devices: SshDevices, tmp_path: Path, tag: str
) -> None:
    ref = f"asteroid-edge/deploytest{tag}:1"
    inv = parse_inventory(
        {
            "cluster": f"st{tag}",
            "coordinator_host": devices.bridge_ip,
            "remote_dir": str(tmp_path / "remote"),
            "known_hosts": str(devices.known_hosts),
            "devices": [
                {
                    "name": "d1",
                    "host": devices.addresses["d1"],
                    "ssh_identity": str(devices.client_key),
                    "roles": ["control", "worker"],
                    "memory": "256MiB",
                    "cpus": 1,
                }
            ],
        }
    )
    archive = tmp_path / "image.tar"
    try:
        image_id = tiny_image(ref, tmp_path)
        docker("save", "-o", str(archive), ref)
        docker("rmi", ref)
        spec = ContainerSpec(
            name=f"asteroid-st{tag}-d1-x",
            service="worker",
            image=ref,
            image_id=image_id,
            args=(),
            env_file=None,
            mounts=(),
            volumes=(),
            cpus=1,
            memory=None,
            labels=(),
            health="true",
        )
        want = DesiredDevice(inv.devices[0], f"{tmp_path}/remote/st{tag}/d1", {}, (spec,))
        deployment = Deployment(inv, tmp_path, "1", "", save=lambda _ref: ["cat", str(archive)])

        ships = [a for a in plan_up(want, deployment.probe(want)) if a.kind == "ship-image"]
        assert [(a.target, a.image_id) for a in ships] == [(ref, image_id)]
        deployment.apply(want, ships[0])
        have = deployment.probe(want)
        assert have.images[ref] == image_id and have.shipped == {ref: image_id}
        assert [a for a in plan_up(want, have) if a.kind == "ship-image"] == []

        actions = plan_down(want, have)
        assert [(a.kind, a.target) for a in actions] == [
            ("remove-image", ref),
            ("remove-dir", want.directory),
        ]
        for action in actions:
            deployment.apply(want, action)
        assert docker("image", "inspect", ref, check=False) == "[]"
        assert not Path(want.directory).exists()
        assert plan_down(want, deployment.probe(want)) == []
    finally:
        docker("rmi", "-f", ref, check=False)
