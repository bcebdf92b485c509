"""Inventories, key sets and image ids for the deploy's pure-core tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.curve import create_key_set
from services.deploy.apply import read_key_set
from services.deploy.desired import DesiredDevice, desired_state, needed_images
from services.deploy.inventory import Inventory, parse_inventory

ACL = Path(__file__).resolve().parents[2] / "deploy" / "redis-acl.conf"
VERSION = "1.2.3"


def inventory(**over: Any) -> Inventory:
    data: dict[str, Any] = {
        "cluster": "lab",
        "coordinator_host": "10.0.0.1",
        "coordinator_port": 6000,
        "redis_port": 6400,
        "remote_dir": "/srv/ae",
        "devices": [
            {"name": "ctl", "host": "10.0.0.1", "roles": ["control"], "memory": "1GiB", "cpus": 1},
            {"name": "w1", "host": "10.0.0.2", "roles": ["worker"], "memory": "2GiB", "cpus": 2},
            {
                "name": "w2",
                "host": "10.0.0.3",
                "roles": ["worker"],
                "memory": "512MiB",
                "cpus": 0.5,
                "data_port": 7000,
            },
        ],
    }
    data.update(over)
    return parse_inventory(data)


def key_set(root: Path, workers: tuple[str, ...] = ("w1", "w2")) -> dict[str, bytes]:
    create_key_set(root, workers, ["planner", "profiler"], ["op"])
    return read_key_set(root)


def known(inv: Inventory) -> Inventory:
    """The inventory as a deploy sees it after asking its devices: amd64 where none is stated."""
    return inv.with_arches({d.name: d.arch or "amd64" for d in inv.devices})


def image_ids(inv: Inventory, salt: str = "") -> dict[str, str]:
    return {
        ref: "sha256:" + format(abs(hash(ref + salt)), "x").rjust(64, "0")[:64]
        for ref in needed_images(known(inv), VERSION)
    }


def desired(inv: Inventory, keys: dict[str, bytes], salt: str = "") -> list[DesiredDevice]:
    return desired_state(known(inv), keys, ACL.read_text(), image_ids(inv, salt), VERSION)
