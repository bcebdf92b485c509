"""Cgroup files read and written with errors that name them, for the testbed's cgroup code.

`services.testbed.cgroups` (a device's groups) and `services.testbed.cpusets`
(its cores) both build on these.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from common.errors import AsteroidError

__all__ = [
    "PARENT",
    "CgroupError",
    "Hierarchy",
    "field",
    "own_paths",
    "pids",
    "read",
    "read_int",
    "read_or_empty",
    "write",
]

PARENT = "asteroid-testbed"
"""Directory holding every testbed's groups, in each hierarchy."""


class CgroupError(AsteroidError):
    """A cgroup could not be created, configured or removed; the message names the file."""


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's groups live.

    Attributes:
        controller: "cpu", "memory" or "freezer".
        version: 1 or 2.
        mount: The hierarchy's mount point.
        own: This process's cgroup in that hierarchy (a path below `mount`).

    """

    controller: str
    version: int
    mount: Path
    own: Path


def own_paths(root: Path) -> tuple[str, dict[str, str]]:
    """(v2 path, {v1 controller: path}) of this process, from /proc/self/cgroup."""
    v2, v1 = "/", {}
    with contextlib.suppress(OSError):
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                v2 = parts[2]
            else:
                for c in parts[1].split(","):
                    v1[c] = parts[2]
    return v2, v1


def write(path: Path, value: str) -> None:
    """Write `value` to a cgroup file; CgroupError names the file and the value."""
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc}") from exc


def read(path: Path) -> str:
    """A cgroup file's text; CgroupError names the file."""
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupError(f"cannot read {path}: {exc}") from exc


def read_or_empty(path: Path) -> str:
    """The file's stripped text, "" where it does not exist (yet)."""
    return read(path).strip() if path.exists() else ""


def read_int(path: Path) -> int:
    """A cgroup file's number (0 for anything else, such as "max")."""
    raw = read(path).strip()
    return int(raw) if raw.isdigit() else 0


def field(text: str, name: str) -> int:
    """The value of line `name N` in a flat-keyed cgroup file (0 when absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return 0


def pids(group: Path) -> list[int]:
    """The processes directly in `group` (none where it is gone)."""
    with contextlib.suppress(OSError):
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    return []
