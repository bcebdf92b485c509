from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from common.errors import ConfigError
from services.deploy.inventory import load_inventory, parse_inventory

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "devices.example.yaml"


def inventory(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "cluster": "lab",
        "coordinator_host": "10.0.0.1",
        "devices": [
            {"name": "ctl", "host": "10.0.0.1", "roles": ["control"], "memory": "1GiB", "cpus": 1},
            {"name": "w1", "host": "10.0.0.2", "roles": ["worker"], "memory": "2GiB", "cpus": 2},
        ],
    }
    base.update(over)
    return base


def test_the_example_loads():
    inv = load_inventory(EXAMPLE)
    assert inv.control.name == "xavier"
    assert inv.control.roles == ("control", "worker")
    assert inv.coordinator == "tcp://192.168.1.10:5555"
    assert inv.device("nano-1").memory == 2 << 30
    assert inv.devices[0].ssh_identity == Path("~/.ssh/id_ed25519").expanduser()


def test_defaults():
    inv = parse_inventory(inventory())
    w1 = inv.device("w1")
    assert (w1.ssh_user, w1.ssh_port, w1.arch, w1.data_port) == ("root", 22, None, 5556)
    assert inv.registry is None


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("ssh_port", 0, "device w1: ssh_port:"),
        ("ssh_port", 70000, "device w1: ssh_port:"),
        ("memory", "2XB", "device w1: memory:"),
        ("memory", "1MiB", "device w1: memory: 1.0MiB is below"),
        ("roles", ["gpu"], "device w1: roles"),
        ("roles", [], "device w1: roles: needs at least one"),
        ("roles", ["worker", "worker"], "device w1: roles: names a role twice"),
        ("cpus", 0, "device w1: cpus:"),
        ("host", "-oProxyCommand=x", "device w1: host: '-oProxyCommand=x' is not a host"),
        ("host", "a b", "device w1: host:"),
        ("ssh_user", "root;rm", "device w1: ssh_user:"),
        ("name", "W_1", "device W_1: name: must be"),
        ("arch", "mips", "device w1: arch:"),
        ("colour", "red", "device w1: colour: unknown key"),
    ],
)
def test_a_bad_device_field_is_one_line_naming_device_and_field(field, value, expect):
    data = inventory()
    data["devices"][1][field] = value
    with pytest.raises(ConfigError) as err:
        parse_inventory(data)
    assert expect in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        ({"cluster": "Lab!"}, "cluster: must be"),
        ({"remote_dir": "relative/dir"}, "remote_dir:"),
        ({"remote_dir": "/var/../etc"}, "remote_dir:"),
        ({"registry": "http://reg"}, "registry:"),
        ({"extra": 1}, "extra: unknown key"),
        ({"devices": []}, "devices:"),
    ],
)
def test_bad_cluster_fields(over, expect):
    with pytest.raises(ConfigError, match=expect):
        parse_inventory(inventory(**over))


def test_exactly_one_control_and_some_worker():
    data = inventory()
    data["devices"][1]["roles"] = ["control"]
    with pytest.raises(ConfigError, match="exactly one device must have role control"):
        parse_inventory(data)
    data["devices"][1]["roles"] = ["worker"]
    data["devices"][1]["name"] = "ctl"
    with pytest.raises(ConfigError, match="ctl repeat"):
        parse_inventory(data)
    data = inventory()
    data["devices"][1]["roles"] = ["control"]
    data["devices"] = data["devices"][1:]
    with pytest.raises(ConfigError, match="no device has role worker"):
        parse_inventory(data)


def test_unreadable_or_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read inventory"):
        load_inventory(tmp_path / "missing.yaml")
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_inventory(path)
    path.write_text("cluster: [unclosed")
    with pytest.raises(ConfigError, match="cannot read inventory") as err:
        load_inventory(path)
    assert "\n" not in str(err.value)
