"""Cgroups of emulated devices: a CPU quota, a memory limit, a freezer, per device.

A device is ``asteroid-testbed/<tag>/<device>`` in each controller's hierarchy:
the CPU quota and the freezer sit on that group, so the device's processes
share one CPU budget and pause together, as on a real board. Processes live
in leaves below it (``worker``, ``profiler``), each with the device's memory
limit: the profiler measures under exactly the limit the worker trains under,
and an idle profiler's footprint does not eat into the worker's budget.

Both cgroup versions work: v1 (one mount per controller, ``cpu.cfs_*``,
``memory.limit_in_bytes`` plus ``memory.memsw.*`` so that swap cannot hide an
OOM, ``freezer.state``) and v2 (``cpu.max``, ``memory.max`` with
``memory.swap.max`` 0, ``cgroup.freeze``). The groups go below this process's
own cgroup when it may create children there (outer limits keep binding), else
at the root of the hierarchy. ``root`` exists for tests on a fake tree.

A device may also be given cores of its own (``cpus``, e.g. "0-1"): a group in
the cpuset hierarchy, made only for such devices (`services.testbed.cpusets`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from services.testbed.cgroup_files import PARENT, CgroupError, Hierarchy
from services.testbed.cgroup_files import field as _field
from services.testbed.cgroup_files import own_paths as _own_paths
from services.testbed.cgroup_files import pids as _pids
from services.testbed.cgroup_files import read as _read
from services.testbed.cgroup_files import read_int as _read_int
from services.testbed.cgroup_files import write as _write
from services.testbed.cpusets import cpuset_hierarchy, make_cpuset

__all__ = [
    "CONTROLLERS",
    "PARENT",
    "ROLES",
    "CgroupError",
    "DeviceCgroup",
    "Hierarchy",
    "cpu_period_quota",
    "cpuset_hierarchy",
    "find_testbed_groups",
    "hierarchies",
    "remove_trees",
]

CONTROLLERS = ("cpu", "memory", "freezer")
"""What a device needs: a CPU quota, a memory limit and pausing."""

ROLES = ("worker", "profiler")
"""Leaves of a device group, one per kind of process it runs."""

_UNLIMITED = 1 << 60


def hierarchies(root: Path = Path("/")) -> dict[str, Hierarchy]:
    """The hierarchy used for each of `CONTROLLERS`; a v1 mount wins over v2 (hybrid hosts).

    Raises:
        CgroupError: A controller is in neither version, naming what was looked at.

    """
    base = root / "sys/fs/cgroup"
    v2_path, v1_paths = _own_paths(root)
    v2_mount: Path | None = None
    v2_controllers: set[str] = set()
    for cand in (base, base / "unified"):
        with contextlib.suppress(OSError):
            v2_controllers = set((cand / "cgroup.controllers").read_text().split())
            v2_mount = cand
            break
    out: dict[str, Hierarchy] = {}
    for controller in CONTROLLERS:
        v1 = []
        with contextlib.suppress(OSError):
            v1 = [
                d
                for d in sorted(base.iterdir())
                if d.is_dir()
                and controller in d.name.split(",")
                and not (d / "cgroup.controllers").exists()
            ]
        if v1:
            own = v1_paths.get(controller, "/")
            out[controller] = Hierarchy(controller, 1, v1[0], v1[0] / own.lstrip("/"))
        elif v2_mount is not None and (controller in v2_controllers or controller == "freezer"):
            # the v2 freezer is cgroup.freeze in every non-root group, not a controller
            out[controller] = Hierarchy(controller, 2, v2_mount, v2_mount / v2_path.lstrip("/"))
        else:
            raise CgroupError(
                f"no cgroup hierarchy with the {controller} controller under {base} "
                f"(v1 mounts: none named {controller}; v2 controllers: "
                f"{sorted(v2_controllers) or 'none'})"
            )
    return out


def cpu_period_quota(cpu: float) -> tuple[int, int]:
    """CFS (period, quota) in microseconds giving `cpu` cores.

    A 10 ms period rather than the kernel's 100 ms: a device at 0.15 cores then
    runs 1.5 ms in every 10 ms instead of 15 ms and stalling 85 ms, which would
    turn a small pipeline step into a long stall. The kernel wants a quota of at
    least 1 ms, so smaller shares use a longer period.
    """
    if not cpu > 0:
        raise CgroupError(f"cpu must be positive cores, got {cpu}")
    period = 10_000 if cpu >= 0.1 else 100_000
    return period, max(1000, round(cpu * period))


def _v2_wanted(h: Hierarchy) -> list[str]:
    controllers = _read(h.mount / "cgroup.controllers").split()
    return [c for c in ("cpu", "memory") if c in controllers]


def _base(h: Hierarchy) -> Path:
    """Where `PARENT` goes: below this process's group if children can be made there.

    On v2 a group holding processes cannot hand controllers to children (the
    no-internal-processes rule), so there the root is used instead.
    """
    for cand in (h.own, h.mount):
        made = not (cand / PARENT).exists()
        try:
            (cand / PARENT).mkdir(exist_ok=True)
            if h.version == 2 and _v2_wanted(h):
                enable = " ".join(f"+{c}" for c in _v2_wanted(h))
                (cand / "cgroup.subtree_control").write_text(enable)
        except (OSError, CgroupError):
            if made:
                with contextlib.suppress(OSError):
                    (cand / PARENT).rmdir()
            continue
        return cand
    raise CgroupError(f"cannot create {PARENT} under {h.own} or {h.mount}")


def _enable_v2(h: Hierarchy, base: Path, group: Path) -> None:
    """Hand cpu and memory down from `base` to the children of `group` (v2)."""
    wanted = _v2_wanted(h)
    if not wanted:
        return
    d = base
    for part in (PARENT, *group.relative_to(base / PARENT).parts, None):
        _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        if part is not None:
            d = d / part


class DeviceCgroup:
    """One device's group in every hierarchy, with a leaf per role below it."""

    def __init__(
        self,
        tag: str,
        device: str,
        root: Path = Path("/"),
        bases: dict[str, Path] | None = None,
    ) -> None:
        """Name the groups; `bases` says where an existing testbed's `PARENT` is, per controller."""
        self.tag, self.device = tag, device
        self.h = hierarchies(root)
        self.cpuset_h = cpuset_hierarchy(root)
        self._bases: dict[str, Path] = dict(bases or {})

    def base(self, controller: str) -> Path:
        """The group below which `PARENT` lives in `controller`'s hierarchy."""
        if controller not in self._bases:
            h = self.cpuset_h if controller == "cpuset" else self.h[controller]
            if h is None:
                raise CgroupError("this machine has no cpuset controller: no cores per device")
            self._bases[controller] = _base(h)
        return self._bases[controller]

    def cpuset_group(self) -> Path | None:
        """The device's cpuset group where one exists (devices given cores), found, not made."""
        h = self.cpuset_h
        if h is None:
            return None
        cands = [self._bases["cpuset"]] if "cpuset" in self._bases else [h.own, h.mount]
        for cand in cands:
            g = cand / PARENT / self.tag / self.device
            if g.is_dir():
                return g
        return None

    def _groups(self) -> list[Path]:
        """The device's group in every hierarchy it uses (the cpuset one where it has cores)."""
        got = self.cpuset_group()
        return [self.group(c) for c in self.h] + ([got] if got is not None else [])

    def group(self, controller: str) -> Path:
        """The device's directory in `controller`'s hierarchy (created by `create`)."""
        return self.base(controller) / PARENT / self.tag / self.device

    def create(
        self,
        cpu: float,
        memory_bytes: int,
        roles: tuple[str, ...] = ROLES,
        cpus: str | None = None,
    ) -> None:
        """Make the groups and set the quota, the per-leaf memory limit and the cores (`cpus`)."""
        done: set[Path] = set()
        for controller, h in self.h.items():
            g = self.group(controller)
            for leaf in (g, *(g / r for r in roles)):
                if leaf in done:
                    continue
                try:
                    leaf.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise CgroupError(f"cannot create cgroup {leaf}: {exc}") from exc
                done.add(leaf)
            if h.version == 2 and controller != "freezer":
                _enable_v2(h, self.base(controller), g)
        self.set_cpu(cpu)
        for role in roles:
            self._limit_memory(self.group("memory") / role, memory_bytes)
        if cpus is not None:
            assert self.cpuset_h is not None  # base() raised otherwise
            make_cpuset(self.cpuset_h, self.base("cpuset"), self.tag, self.device, cpus, roles)

    def cpus(self) -> str | None:
        """The device's cores as the kernel lists them, None where it has no cores of its own."""
        g = self.cpuset_group()
        return None if g is None else _read(g / "cpuset.cpus").strip() or None

    def _limit_memory(self, leaf: Path, limit: int) -> None:
        if self.h["memory"].version == 2:
            _write(leaf / "memory.max", str(limit))
            if (leaf / "memory.swap.max").exists():
                _write(leaf / "memory.swap.max", "0")
            return
        _write(leaf / "memory.limit_in_bytes", str(limit))
        if (leaf / "memory.memsw.limit_in_bytes").exists():
            _write(leaf / "memory.memsw.limit_in_bytes", str(limit))

    def set_cpu(self, cpu: float) -> None:
        """Give the device `cpu` cores from now on (every process in it shares them)."""
        period, quota = cpu_period_quota(cpu)
        g = self.group("cpu")
        if self.h["cpu"].version == 2:
            _write(g / "cpu.max", f"{quota} {period}")
            return
        # order the two writes so the share in between never exceeds the new one (a
        # limited parent would refuse that)
        cur = _read_int(g / "cpu.cfs_period_us") if (g / "cpu.cfs_period_us").exists() else 0
        if 0 < cur < period:
            _write(g / "cpu.cfs_period_us", str(period))
            _write(g / "cpu.cfs_quota_us", str(quota))
        else:
            _write(g / "cpu.cfs_quota_us", str(quota))
            _write(g / "cpu.cfs_period_us", str(period))

    def cpu(self) -> float | None:
        """The device's quota in cores, None when unlimited."""
        g = self.group("cpu")
        if self.h["cpu"].version == 2:
            parts = _read(g / "cpu.max").split()
            if len(parts) == 2 and parts[0].isdigit() and int(parts[1]) > 0:
                return int(parts[0]) / int(parts[1])
            return None
        quota = _read(g / "cpu.cfs_quota_us").strip()
        period = _read_int(g / "cpu.cfs_period_us")
        return int(quota) / period if quota.isdigit() and period else None

    def memory_limit(self, role: str = "worker") -> int | None:
        """The memory limit of one leaf in bytes, None when unlimited."""
        leaf = self.group("memory") / role
        name = "memory.max" if self.h["memory"].version == 2 else "memory.limit_in_bytes"
        value = _read_int(leaf / name)
        return value if 0 < value < _UNLIMITED else None

    def procs_files(self, role: str) -> list[Path]:
        """The files a process writes its pid to, one per hierarchy, to join leaf `role`."""
        return sorted({g / role / "cgroup.procs" for g in self._groups()})

    def attach(self, pid: int, role: str = "worker") -> None:
        """Move process `pid` (all its threads) into leaf `role` in every hierarchy."""
        for f in self.procs_files(role):
            _write(f, str(pid))

    def pids(self) -> list[int]:
        """Every process in the device, over all hierarchies and leaves."""
        found: set[int] = set()
        for g in self._groups():
            for d in (g, *(p for p in g.iterdir() if p.is_dir())) if g.is_dir() else ():
                found.update(_pids(d))
        return sorted(found)

    def freeze(self) -> None:
        """Stop every process of the device where it stands (they keep their memory)."""
        self._freezer(True)

    def thaw(self) -> None:
        """Let a frozen device run again."""
        self._freezer(False)

    def _freezer(self, frozen: bool) -> None:
        g = self.group("freezer")
        if self.h["freezer"].version == 2:
            _write(g / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(g / "freezer.state", "FROZEN" if frozen else "THAWED")

    def frozen(self) -> bool:
        """Whether the device is frozen (or freezing)."""
        g = self.group("freezer")
        if self.h["freezer"].version == 2:
            return _field(_read(g / "cgroup.events"), "frozen") == 1
        return _read(g / "freezer.state").strip() != "THAWED"

    def peak_memory(self, role: str = "worker") -> int:
        """Most bytes leaf `role` has used (0 when the kernel does not record it)."""
        leaf = self.group("memory") / role
        name = "memory.peak" if self.h["memory"].version == 2 else "memory.max_usage_in_bytes"
        return _read_int(leaf / name) if (leaf / name).exists() else 0

    def reset_peak(self, role: str = "worker") -> None:
        """Start the high-water mark of leaf `role` afresh (v1 only; v2's cannot be reset)."""
        leaf = self.group("memory") / role
        if self.h["memory"].version == 1 and (leaf / "memory.max_usage_in_bytes").exists():
            _write(leaf / "memory.max_usage_in_bytes", "0")

    def oom_kills(self) -> int:
        """Processes of the device the kernel killed for exceeding the memory limit."""
        g = self.group("memory")
        total = 0
        name = "memory.events" if self.h["memory"].version == 2 else "memory.oom_control"
        for leaf in (p for p in g.iterdir() if p.is_dir()) if g.is_dir() else ():
            if (leaf / name).exists():
                total += _field(_read(leaf / name), "oom_kill")
        return total

    def kill(self) -> None:
        """SIGKILL every process of the device; a frozen device is thawed so they can die."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(CgroupError):
            if self.frozen():
                self.thaw()

    def remove(self, timeout_s: float = 10.0) -> None:
        """Kill what is left inside, then remove the groups (and the testbed's, once empty)."""
        groups = self._groups()
        remove_trees(groups, timeout_s)
        for g in groups:
            for parent in (g.parent, g.parent.parent):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # succeeds only once no other device or testbed uses it


def _thaw(group: Path) -> None:
    for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        with contextlib.suppress(OSError):
            if (group / name).exists():
                (group / name).write_text(value)


def _kill_all(dirs: list[Path]) -> None:
    for d in dirs:
        for pid in _pids(d):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def remove_trees(groups: list[Path], timeout_s: float = 10.0) -> None:
    """Kill every process in `groups` and below, then rmdir them, leaves first.

    The groups of one device in all hierarchies go together: a process frozen
    in the freezer hierarchy cannot act on SIGKILL, so everything is killed
    and thawed before any directory is removed.

    Raises:
        CgroupError: A process would not die or a group stayed busy within `timeout_s`.

    """
    dirs: list[Path] = []
    for g in groups:
        if g.is_dir():
            dirs += [d for d in g.rglob("*") if d.is_dir()] + [g]
    dirs.sort(key=lambda p: -len(p.parts))
    _kill_all(dirs)
    for d in reversed(dirs):
        _thaw(d)
    deadline = time.monotonic() + timeout_s
    for d in dirs:
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY) or (time.monotonic() > deadline):
                    raise CgroupError(
                        f"cannot remove cgroup {d} (processes {_pids(d)}): {exc}"
                    ) from exc
                _kill_all([d])
                time.sleep(0.05)


def find_testbed_groups(root: Path = Path("/"), max_depth: int = 4) -> list[Path]:
    """Every ``asteroid-testbed/<tag>`` group in any hierarchy, wherever it was created.

    A testbed nests its groups below the cgroup of the process that started it,
    which another shell (say, the one running `asteroid testbed down`) does not
    share, so the hierarchies are searched to a bounded depth.
    """
    found: list[Path] = []
    with contextlib.suppress(CgroupError):
        mounts = {h.mount for h in hierarchies(root).values()}
        cpuset = cpuset_hierarchy(root)
        if cpuset is not None:
            mounts.add(cpuset.mount)
        for mount in sorted(mounts):
            level = [mount]
            for _ in range(max_depth):
                nxt = []
                for d in level:
                    with contextlib.suppress(OSError):
                        for child in d.iterdir():
                            if not child.is_dir():
                                continue
                            if child.name == PARENT:
                                found += sorted(p for p in child.iterdir() if p.is_dir())
                            else:
                                nxt.append(child)
                level = nxt
    return found
