"""Finding testbeds by their names alone: what `down` removes and `status` shows.

A testbed leaves four kinds of traces, each named after its tag: namespaces
``ae-<tag>-<device>``, links ``aebr-<tag>`` and ``aev-<tag>-<i>``, cgroups
``asteroid-testbed/<tag>``, and an iptables FORWARD rule commented
``asteroid-testbed-<tag>``. A crashed or SIGKILLed run leaves them behind
(its processes die with it, the kernel objects do not), so these functions
work from the names, without the run's `Testbed` object, from any shell.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import AsteroidError
from services.testbed.cgroups import (
    CgroupError,
    DeviceCgroup,
    find_testbed_groups,
    hierarchies,
    remove_trees,
)
from services.testbed.net import (
    NS_IFACE,
    NetError,
    delete_commands,
    link_summary,
    link_tag,
    list_forward_rules,
    list_links,
    list_netns,
    netns_name,
    netns_pids,
    netns_tag,
    run,
)

__all__ = ["DeviceStatus", "Found", "cleanup_leftovers", "find", "remove", "status"]


@dataclass
class Found:
    """Everything of one testbed tag that exists right now."""

    tag: str
    netns: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)
    cgroups: list[Path] = field(default_factory=list)
    forward_rule: list[str] = field(default_factory=list)
    """Its FORWARD rule as `iptables -D` arguments, empty when it has none."""

    def devices(self) -> list[str]:
        """Device names, from the namespaces and the cgroups."""
        names = {ns.split("-", 2)[2] for ns in self.netns}
        for g in self.cgroups:
            with contextlib.suppress(OSError):
                names.update(d.name for d in g.iterdir() if d.is_dir())
        return sorted(names)


def find(tag_prefix: str = "", root: Path = Path("/")) -> dict[str, Found]:
    """Every testbed whose tag starts with `tag_prefix`, by tag."""
    out: dict[str, Found] = {}

    def entry(tag: str) -> Found:
        return out.setdefault(tag, Found(tag))

    for ns in list_netns():
        tag = netns_tag(ns)
        if tag is not None and tag.startswith(tag_prefix):
            entry(tag).netns.append(ns)
    for link, peer in list_links().items():
        tag = link_tag(link)
        if tag is not None and tag.startswith(tag_prefix):
            entry(tag).links[link] = peer
    for g in find_testbed_groups(root):
        if g.name.startswith(tag_prefix):
            entry(g.name).cgroups.append(g)
    for tag, rule in list_forward_rules().items():
        if tag.startswith(tag_prefix):
            entry(tag).forward_rule = rule
    return out


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").split("\0")).strip()


def remove(found: Found) -> list[str]:
    """Kill the testbed's processes and delete its namespaces, links and cgroups.

    Everything is attempted even when a step fails; the failures are raised
    together at the end.

    Returns:
        One line per thing removed, for people.

    Raises:
        AsteroidError: Something could not be removed (each failure named).

    """
    done: list[str] = []
    errors: list[str] = []
    for ns in found.netns:
        for pid in netns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                line = _cmdline(pid)
                os.kill(pid, signal.SIGKILL)
                done.append(f"process {pid} in {ns}: {line[:100]}")
    try:
        remove_trees(found.cgroups)
        done += [f"cgroup {g}" for g in found.cgroups]
    except CgroupError as exc:
        errors.append(str(exc))
    for g in found.cgroups:
        with contextlib.suppress(OSError):
            g.parent.rmdir()  # the shared parent, once no testbed is left in it
    still: dict[str, str] | None = None
    for cmd in delete_commands(found.netns, list(found.links)):
        what = f"{'namespace' if cmd[1] == 'netns' else 'link'} {cmd[-1]}"
        if cmd[1] == "link":
            still = list_links() if still is None else still  # after the namespaces went
            if cmd[-1] not in still:
                done.append(what)  # a host veth end goes with its namespace
                continue
        try:
            run(cmd)
            done.append(what)
        except NetError as exc:
            # a namespace's veth goes asynchronously after `ip netns del`
            if cmd[1] == "link" and cmd[-1] not in list_links():
                done.append(what)
            else:
                errors.append(str(exc))
    if found.forward_rule:  # after the bridge: while it exists its frames need the rule
        try:
            run(["iptables", "-D", *found.forward_rule])
            done.append(f"iptables rule {' '.join(found.forward_rule)}")
        except NetError as exc:
            errors.append(str(exc))
    if errors:
        raise AsteroidError(f"testbed {found.tag} not fully removed: " + "; ".join(errors))
    return done


def cleanup_leftovers(tag_prefix: str = "", root: Path = Path("/")) -> list[str]:
    """Remove every testbed whose tag starts with `tag_prefix` (all of them by default).

    Returns:
        What was removed, one line each.

    """
    done: list[str] = []
    errors: list[str] = []
    for found in find(tag_prefix, root).values():
        try:
            done += remove(found)
        except AsteroidError as exc:
            errors.append(str(exc))
    if errors:
        raise AsteroidError("; ".join(errors))
    return done


@dataclass
class DeviceStatus:
    """One device of a running (or left-over) testbed, as found on the system."""

    name: str
    netns: str = ""
    address: str = ""
    uplink: str = ""
    downlink: str = ""
    cpu: float | None = None
    memory_limit: int | None = None
    peak_memory: int = 0
    oom_kills: int = 0
    frozen: bool = False
    processes: list[str] = field(default_factory=list)


def _address(ns: str) -> str:
    out = run(["ip", "-n", ns, "-o", "-4", "addr", "show", "dev", NS_IFACE], check=False)
    parts = out.split()
    return parts[parts.index("inet") + 1] if "inet" in parts else ""


def status(tag_prefix: str = "", root: Path = Path("/")) -> dict[str, list[DeviceStatus]]:
    """Every testbed's devices with their links, cgroup figures and processes, by tag."""
    out: dict[str, list[DeviceStatus]] = {}
    try:
        hs = hierarchies(root)
    except CgroupError:
        hs = {}
    for tag, found in sorted(find(tag_prefix, root).items()):
        host_end = {peer: link for link, peer in found.links.items() if peer}
        # where this testbed's groups are, per controller (they need not be ours)
        bases = {
            c: g.parent.parent
            for g in found.cgroups
            for c, h in hs.items()
            if g.is_relative_to(h.mount)
        }
        devices = []
        for name in found.devices():
            ns = netns_name(tag, name)
            st = DeviceStatus(name=name)
            if ns in found.netns:
                st.netns, st.address = ns, _address(ns)
                st.uplink = link_summary(NS_IFACE, ns)
                if ns in host_end:
                    st.downlink = link_summary(host_end[ns], None)
                st.processes = [f"{pid} {_cmdline(pid)[:80]}" for pid in netns_pids(ns)]
            if hs and set(bases) == set(hs):  # else a hierarchy lacks its groups: nothing to read
                with contextlib.suppress(AsteroidError, OSError):
                    cg = DeviceCgroup(tag, name, root, bases=bases)
                    st.cpu, st.memory_limit = cg.cpu(), cg.memory_limit()
                    st.peak_memory, st.oom_kills = cg.peak_memory(), cg.oom_kills()
                    st.frozen = cg.frozen()
            devices.append(st)
        out[tag] = devices
    return out
