"""Cores of a device's own: its group in the cpuset hierarchy (`DeviceCgroup.create(cpus=...)`).

Made only for devices given cores, so the worker's affinity is those cores and
Duan & Wu's lanes can each be pinned to one of them (`services.lib.lanes`).
On v1 every cpuset level starts empty and refuses processes, so the levels
above the device get their parent's cores and memory nodes, the device its own
cores, and its leaves the device's; on v2 the controller is handed down and the
device's ``cpuset.cpus`` set.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from services.testbed.cgroup_files import (
    PARENT,
    CgroupError,
    Hierarchy,
    own_paths,
    read,
    read_or_empty,
    write,
)

__all__ = ["cpuset_hierarchy", "make_cpuset"]


def cpuset_hierarchy(root: Path = Path("/")) -> Hierarchy | None:
    """The cpuset controller's hierarchy (a v1 mount wins over v2), None where it has none."""
    base = root / "sys/fs/cgroup"
    v2_path, v1_paths = own_paths(root)
    with contextlib.suppress(OSError):
        for d in sorted(base.iterdir()):
            if (
                d.is_dir()
                and "cpuset" in d.name.split(",")
                and not (d / "cgroup.controllers").exists()
            ):
                return Hierarchy("cpuset", 1, d, d / v1_paths.get("cpuset", "/").lstrip("/"))
    for cand in (base, base / "unified"):
        with contextlib.suppress(OSError):
            if "cpuset" in (cand / "cgroup.controllers").read_text().split():
                return Hierarchy("cpuset", 2, cand, cand / v2_path.lstrip("/"))
    return None


def make_cpuset(
    h: Hierarchy, base: Path, tag: str, device: str, cpus: str, roles: tuple[str, ...]
) -> Path:
    """Device `device` of testbed `tag` on cores `cpus` (a kernel list such as "0-1"), below `base`.

    Returns the device's group.
    """
    g = base / PARENT / tag / device
    if h.version == 2:
        d = base
        for part in (PARENT, tag, device):
            write(d / "cgroup.subtree_control", "+cpuset")
            d = d / part
            d.mkdir(exist_ok=True)
        write(g / "cpuset.cpus", cpus)
        for role in roles:
            (g / role).mkdir(exist_ok=True)
        return g
    parent = base
    for d in (base / PARENT, base / PARENT / tag, g, *(g / r for r in roles)):
        try:
            d.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {d}: {exc}") from exc
        mine = cpus if d == g else read(parent / "cpuset.cpus").strip()
        if d == g or not read_or_empty(d / "cpuset.cpus"):
            write(d / "cpuset.cpus", mine)
        if not read_or_empty(d / "cpuset.mems"):
            write(d / "cpuset.mems", read(parent / "cpuset.mems").strip())
        parent = d
    return g
