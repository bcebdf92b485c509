"""What a testbed leaves on the system, looked up independently of the code under test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def forward_rules(tag: str) -> list[str]:
    """FORWARD rules whose comment names the testbed `tag` (none without iptables)."""
    if shutil.which("iptables") is None:
        return []
    out = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    return [r for r in out.splitlines() if f"asteroid-testbed-{tag}" in r.split()]


def cgroups(tag: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"**/asteroid-testbed/{tag}") if p.is_dir()]


def traces(tag: str) -> list[str]:
    """Every namespace, link, cgroup and FORWARD rule whose name carries `tag`."""
    return (
        [f"netns {n}" for n in netns() if n.startswith(f"ae-{tag}-")]
        + [f"link {n}" for n in links() if n in (f"aebr-{tag}",) or n.startswith(f"aev-{tag}-")]
        + [f"cgroup {p}" for p in cgroups(tag)]
        + [f"iptables {r}" for r in forward_rules(tag)]
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (its children run in sessions of their own)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found
