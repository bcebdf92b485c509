"""The ssh runner against real sshd processes in network namespaces."""

from __future__ import annotations

import pytest

from services.deploy.inventory import Device
from services.deploy.ssh import Ssh, SshError
from tests.deploy.sshdevices import SshDevices

pytestmark = pytest.mark.integration


def runner(devs: SshDevices, name: str, **over: object) -> Ssh:
    dev = Device.model_validate(
        {
            "name": name,
            "host": devs.addresses[name],
            "ssh_identity": str(devs.client_key),
            "roles": ["worker"],
            "memory": "1GiB",
            "cpus": 1,
            **over,
        }
    )
    return Ssh(dev, devs.known_hosts)


@pytest.mark.parametrize("devices", [["d1", "d2"]], indirect=True)
def test_commands_run_inside_the_device_and_arguments_stay_arguments(devices, tmp_path):
    for name in ("d1", "d2"):
        out = runner(devices, name).run(["ip", "-o", "-4", "addr", "show", "eth0"]).stdout.decode()
        assert f"inet {devices.addresses[name]}/" in out  # the device's namespace, not ours
    target = tmp_path / "x; touch pwned"
    runner(devices, "d1").run(["sh", "-c", 'printf %s "$1" > "$2"', "sh", "a b $HOME", str(target)])
    assert target.read_text() == "a b $HOME"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("devices", [["d1"]], indirect=True)
def test_stdin_and_a_local_pipe_reach_the_device(devices, tmp_path):
    ssh = runner(devices, "d1")
    dest = tmp_path / "piped"
    ssh.run(["sh", "-c", 'cat > "$1"', "sh", str(dest)], data=b"\x00\x01 payload")
    assert dest.read_bytes() == b"\x00\x01 payload"
    src = tmp_path / "big"
    src.write_bytes(bytes(range(256)) * 20_000)
    ssh.pipe_from(["cat", str(src)], ["sh", "-c", f"cat > {dest}"], timeout_s=60)
    assert dest.read_bytes() == src.read_bytes()
    with pytest.raises(SshError, match="the local side failed"):
        ssh.pipe_from(["cat", str(tmp_path / "missing")], ["sh", "-c", "cat > /dev/null"], 60)
    with pytest.raises(SshError, match="the device failed"):
        ssh.pipe_from(["cat", str(src)], ["sh", "-c", "exit 3"], 60)


@pytest.mark.parametrize("devices", [["d1"]], indirect=True)
def test_failures_are_one_error_naming_the_device(devices, tmp_path):
    ssh = runner(devices, "d1")
    with pytest.raises(SshError, match=r"device d1: .*failed \(7\): boom"):
        ssh.run(["sh", "-c", "echo boom >&2; exit 7"])
    with pytest.raises(SshError, match="did not finish within 1 s"):
        ssh.run(["sleep", "30"], timeout_s=1)
    # a host key not in known_hosts is refused, never trusted on first use
    stranger = tmp_path / "known_hosts"
    stranger.write_text("")
    with pytest.raises(SshError, match="device d1"):
        Ssh(ssh.device, stranger).run(["true"])
    # a wrong client key is refused
    with pytest.raises(SshError, match="device d1"):
        runner(devices, "d1", ssh_identity=str(tmp_path / "nokey")).run(["true"])
    # nothing listens there: fails within the connect timeout
    with pytest.raises(SshError, match="device d1"):
        runner(devices, "d1", ssh_port=2222).run(["true"], timeout_s=30)
