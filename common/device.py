"""What names this device, and what it lets this process use.

A device is named by a fingerprint of what makes it fast or slow (CPU model,
visible cores, torch threads, cgroup CPU quota, memory limit), so a profile is
reused on the same device and re-measured on an emulated smaller one; a worker
computes the same fingerprint to find the profiles that describe it. Limits come
from cgroups (v1 or v2, the process's own group and its ancestors) because
emulated devices and containers are cgroups, not machines. Shared in `common`
because the profiler and the worker must compute the fingerprint identically.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.accelerator import AcceleratorInfo

__all__ = [
    "cgroup_memory_limit",
    "cpu_quota",
    "default_threads",
    "device_fingerprint",
    "memory_budget",
    "visible_cores",
]

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _cgroup_dirs(root: Path, controller: str) -> list[Path]:
    """Directories that may hold this process's `controller` limits, deepest first.

    The process's own cgroup and each ancestor (a parent's limit binds too), in
    the v2 hierarchy (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``) and in the
    v1 mount of the controller (``memory``, ``cpu``, ``cpu,cpuacct``, ...).
    """
    base = root / "sys/fs/cgroup"
    v2_path, v1_path = "/", "/"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif controller in parts[1].split(","):
            v1_path = parts[2]
    mounts = [(base, v2_path), (base / "unified", v2_path)]
    with contextlib.suppress(OSError):  # no cgroup file system
        mounts += [
            (d, v1_path)
            for d in sorted(base.iterdir())
            if d.is_dir() and controller in d.name.split(",")
        ]
    dirs: list[Path] = []
    for mount, path in mounts:
        rel = Path(path.lstrip("/"))
        dirs += [mount / p for p in (rel, *rel.parents)]
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The tightest cgroup memory limit on this process (v1 or v2), None when unlimited."""
    limits = []
    for d in _cgroup_dirs(root, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            raw = _read(d / name)
            if raw and raw.isdigit() and 0 < int(raw) < _UNLIMITED:
                limits.append(int(raw))
    return min(limits) if limits else None


def cpu_quota(root: Path = Path("/")) -> float | None:
    """The tightest cgroup CPU quota in cores (v2 ``cpu.max``, v1 CFS), None when unlimited."""
    quotas = []
    for d in _cgroup_dirs(root, "cpu"):
        v2 = (_read(d / "cpu.max") or "").split()
        if len(v2) == 2 and v2[0].isdigit() and v2[1].isdigit() and int(v2[1]) > 0:
            quotas.append(int(v2[0]) / int(v2[1]))
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota and period and quota.isdigit() and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))  # "-1" (unlimited) is not digits
    return min(quotas) if quotas else None


def _meminfo(root: Path, field: str) -> int | None:
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if name == field and rest.split() and rest.split()[0].isdigit():
            return int(rest.split()[0]) * 1024
    return None


def memory_budget(configured: int = 0, root: Path = Path("/")) -> int:
    """Bytes this process may use.

    `configured` if set, else the cgroup limit, else ``MemAvailable`` (0 when
    nothing is known).
    """
    if configured > 0:
        return configured
    return cgroup_memory_limit(root) or _meminfo(root, "MemAvailable") or 0


def resident_bytes(root: Path = Path("/")) -> int:
    """Resident set size of the calling process in bytes (0 when unknown)."""
    fields = (_read(root / "proc/self/statm") or "").split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def training_budget(configured: int = 0, root: Path = Path("/")) -> int:
    """Bytes a worker may still use for training: what the planner should plan with.

    `configured` if set; else the cgroup limit minus what this process already
    holds (the interpreter and torch take a few hundred MiB, which a small
    device's limit must not be planned twice for); else ``MemAvailable``.
    """
    if configured > 0:
        return configured
    limit = cgroup_memory_limit(root)
    if limit is not None:
        return max(0, limit - resident_bytes(root))
    return _meminfo(root, "MemAvailable") or 0


def visible_cores() -> int:
    """Cores this process may run on (its CPU affinity), before any cgroup quota."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(root: Path = Path("/")) -> int:
    """Torch threads that the cores this process may use can keep busy."""
    quota = cpu_quota(root)
    cores = visible_cores()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cpu_model(root: Path) -> str:
    for line in (_read(root / "proc/cpuinfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Hardware", "Model", "cpu model"):
            return " ".join(value.split())
    return platform.processor() or "unknown"


def device_fingerprint(
    threads: int,
    memory_budget: int = 0,
    root: Path = Path("/"),
    accelerator: AcceleratorInfo | None = None,
) -> str:
    """A stable name for "this hardware, as this process may use it".

    Built from the CPU model, the cores visible to the process, the torch thread
    count, the cgroup CPU quota, the GPU computed on (if any) and the memory
    limit (`memory_budget` when configured, else a discrete GPU's own memory,
    else the cgroup limit, else total RAM: all stable, unlike free memory).
    Readable summary first, then a digest of everything. A CPU device's
    fingerprint names no accelerator, as before there were any.
    """
    quota = cpu_quota(root)
    gpu = accelerator if accelerator is not None and accelerator.kind != "cpu" else None
    own = gpu.total_memory if gpu is not None and not gpu.shared_memory else 0
    mem = memory_budget or own or cgroup_memory_limit(root) or _meminfo(root, "MemTotal") or 0
    parts: dict[str, object] = {
        "cpu": _cpu_model(root),
        "arch": platform.machine() or "unknown",
        "cores": visible_cores(),
        "threads": threads,
        "quota": None if quota is None else round(quota, 3),
        "mem_mib": mem >> 20,
    }
    if gpu is not None:  # absent on a CPU, so CPU fingerprints (and their profiles) stay valid
        parts["gpu"] = (gpu.name, gpu.total_memory >> 20, gpu.shared_memory, gpu.capability)
    digest = hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:10]
    q = "" if quota is None else f"-q{quota:g}"
    acc = f"-{gpu.label}" if gpu is not None else ""
    return f"{parts['arch']}-{parts['cores']}c-{threads}t{q}{acc}-{mem / (1 << 30):.1f}g-{digest}"
