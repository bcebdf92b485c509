"""The testbed's network: one bridge, a namespace per device, shaped veth links.

Layout, for testbed tag T on subnet 10.77.0.0/24::

    root namespace: bridge aebr-T (10.77.0.1/24; Redis, coordinator, planner)
      aev-T-0 --veth-- eth0 in namespace ae-T-<device 0> (10.77.0.10/24)
      aev-T-1 --veth-- eth0 in namespace ae-T-<device 1> (10.77.0.11/24)

Interface names carry the device's index, not its name, so they always fit
Linux's 15 characters (``aev-`` + a tag of at most 6 + ``-`` + up to 3
digits); inside its namespace every device's end is simply ``eth0``. The
bridge is never enslaved to a physical interface and namespaces get no
default route, so nothing a device sends can leave the subnet.

Frames between two devices cross the bridge; where the kernel's br_netfilter
is loaded (Docker loads it) they also cross iptables' FORWARD chain, whose
policy Docker sets to DROP, which silently cuts every device off from every
other. So the testbed inserts its own ACCEPT rule for traffic from its bridge
to its bridge, commented with its tag so that `down` (or a later cleanup
that only knows the name) finds and deletes exactly that rule.

Shaping happens where packets leave, on both ends of each veth: the
namespace end shapes what the device sends, the host end what it receives,
so a transfer from a to b crosses a's uplink and b's downlink. Each end gets
an HTB class at the link rate (TCP goodput then measures ~95.6% of it: the
Ethernet, IP and TCP headers of a 1514-byte frame, as on a real link) over a
FIFO of about 100 ms, and a sibling class whose FIFO holds nothing, i.e. drops
everything: a classic-BPF filter sends a random `loss_pct` of packets there,
or all of them while the link is cut. Latency needs the kernel's ``netem``
queue; where it is missing (some minimal kernels) the link has no added delay
and `Testbed` says so. Builders are pure (lists of argv) so they are tested
without root; `run` executes them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence

from common.errors import AsteroidError, ConfigError

__all__ = [
    "NS_IFACE",
    "Cmd",
    "NetError",
    "bridge_commands",
    "bridge_name",
    "check_tag",
    "delete_commands",
    "device_commands",
    "drop_bytecode",
    "forward_rule",
    "forward_tag",
    "host_veth",
    "link_commands",
    "link_is_up",
    "link_state_commands",
    "link_summary",
    "link_tag",
    "list_forward_rules",
    "list_links",
    "list_netns",
    "loss_commands",
    "loss_of_bytecode",
    "netem_available",
    "netns_name",
    "netns_pids",
    "netns_tag",
    "new_tag",
    "overlaps",
    "queue_packets",
    "run",
    "run_all",
    "shaping_commands",
]

Cmd = list[str]

NS_IFACE = "eth0"
"""A device's end of its link, inside its namespace."""

_TAG = re.compile(r"^[a-z0-9]{1,6}$")
_LINK = re.compile(r"^ae(?:br|v)-([a-z0-9]{1,6})(?:-\d{1,3})?$")
_NETNS = re.compile(r"^ae-([a-z0-9]{1,6})-([a-z0-9-]+)$")
_MTU_FRAME = 1514
_SKF_AD_RANDOM = 0xFFFFF000 + 56  # classic BPF: load a random 32-bit number
_MATCH = 0xFFFFFFFF  # cls_bpf: "matched, use the filter's classid"


class NetError(AsteroidError):
    """An ip/tc command failed; the message has the command and its stderr."""


def new_tag() -> str:
    """A fresh testbed tag: six hex digits, so that testbeds and leftovers do not collide."""
    return secrets.token_hex(3)


def check_tag(tag: str) -> str:
    """`tag` if it fits interface names (1-6 of a-z, 0-9), else ConfigError."""
    if not _TAG.match(tag):
        raise ConfigError(f"testbed tag must be 1-6 lower-case letters or digits, got {tag!r}")
    return tag


def bridge_name(tag: str) -> str:
    """The testbed's bridge in the root namespace."""
    return f"aebr-{check_tag(tag)}"


def host_veth(tag: str, index: int) -> str:
    """The root-namespace end of device `index`'s link."""
    if not 0 <= index < 1000:
        raise ConfigError(f"device index must be 0-999, got {index}")
    return f"aev-{check_tag(tag)}-{index}"


def netns_name(tag: str, device: str) -> str:
    """The namespace of `device`."""
    return f"ae-{check_tag(tag)}-{device}"


def link_tag(name: str) -> str | None:
    """The testbed tag of one of our links (bridge or host veth), None for any other link."""
    m = _LINK.match(name.split("@", 1)[0])
    return m.group(1) if m else None


def netns_tag(name: str) -> str | None:
    """The testbed tag of one of our namespaces, None for any other namespace."""
    m = _NETNS.match(name)
    return m.group(1) if m else None


def _prefix(subnet: str) -> int:
    return ipaddress.IPv4Network(subnet).prefixlen


def bridge_commands(tag: str, subnet: str, bridge_ip: str, iptables: bool = False) -> list[Cmd]:
    """Create the bridge with the host side's address and bring it up.

    With `iptables` (the tool is installed, so a FORWARD policy may drop
    bridged frames), also accept forwarding from the bridge to itself.
    """
    br = bridge_name(tag)
    accept = [["iptables", "-I", *forward_rule(tag)]] if iptables else []
    return [
        *accept,
        ["ip", "link", "add", "name", br, "type", "bridge"],
        ["ip", "addr", "add", f"{bridge_ip}/{_prefix(subnet)}", "dev", br],
        ["ip", "link", "set", br, "up"],
    ]


FORWARD_COMMENT = "asteroid-testbed-"
"""Prefix of the comment on the testbed's FORWARD rule; the tag follows it."""


def forward_rule(tag: str) -> list[str]:
    """The FORWARD rule (after `-I`/`-D`) that lets devices of testbed `tag` reach each other."""
    br = bridge_name(tag)
    comment = FORWARD_COMMENT + check_tag(tag)
    return ["FORWARD", "-i", br, "-o", br, "-m", "comment", "--comment", comment, "-j", "ACCEPT"]


def forward_tag(rule: str) -> str | None:
    """The testbed tag of a rule as `iptables -S` prints it, None for a rule not ours."""
    m = re.search(r"--comment \"?" + re.escape(FORWARD_COMMENT) + r"([a-z0-9]+)\"?(\s|$)", rule)
    return m.group(1) if m else None


def list_forward_rules() -> dict[str, list[str]]:
    """Our FORWARD rules by tag, as `-D` arguments; none where iptables is not installed."""
    if shutil.which("iptables") is None:
        return {}
    out: dict[str, list[str]] = {}
    for line in run(["iptables", "-S", "FORWARD"], check=False).splitlines():
        tag = forward_tag(line)
        if tag is not None and line.startswith("-A FORWARD "):
            out[tag] = forward_rule(tag)
    return out


def device_commands(tag: str, index: int, device: str, subnet: str, address: str) -> list[Cmd]:
    """Create device `index`'s namespace and link, address it and bring both ends up."""
    ns, hv = netns_name(tag, device), host_veth(tag, index)
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", hv, "type", "veth", "peer", "name", NS_IFACE, "netns", ns],
        ["ip", "link", "set", hv, "master", bridge_name(tag)],
        ["ip", "link", "set", hv, "up"],
        ["ip", "-n", ns, "addr", "add", f"{address}/{_prefix(subnet)}", "dev", NS_IFACE],
        ["ip", "-n", ns, "link", "set", NS_IFACE, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]


def queue_packets(bandwidth_bps: float, seconds: float = 0.1) -> int:
    """FIFO length holding about `seconds` of full frames at the link rate (64-1000)."""
    return max(64, min(1000, math.ceil(bandwidth_bps * seconds / 8 / _MTU_FRAME)))


def drop_bytecode(loss_pct: float) -> str:
    """Classic BPF (tc's "bytecode" text) matching a random `loss_pct` percent of packets.

    0 matches nothing and 100 everything; in between it loads a random 32-bit
    number and matches when it falls below loss_pct/100 of the range.
    """
    if loss_pct <= 0:
        return "1,6 0 0 0"
    if loss_pct >= 100:
        return f"1,6 0 0 {_MATCH}"
    threshold = min(_MATCH, round(loss_pct / 100 * 2**32))
    return f"4,32 0 0 {_SKF_AD_RANDOM},53 1 0 {threshold},6 0 0 {_MATCH},6 0 0 0"


def _tc(netns: str | None) -> Cmd:
    return ["tc", "-n", netns] if netns else ["tc"]


def loss_commands(iface: str, netns: str | None, loss_pct: float) -> list[Cmd]:
    """Send `loss_pct` percent of `iface`'s outgoing packets to the dropping class."""
    return [
        [
            *_tc(netns),
            "filter",
            "replace",
            "dev",
            iface,
            "parent",
            "1:",
            "protocol",
            "all",
            "prio",
            "1",
            "handle",
            "1",
            "bpf",
            "bytecode",
            drop_bytecode(loss_pct),
            "classid",
            "1:20",
        ]
    ]


def shaping_commands(
    iface: str,
    netns: str | None,
    bandwidth_bps: float,
    latency_ms: float = 0.0,
    loss_pct: float = 0.0,
    netem: bool = False,
) -> list[Cmd]:
    """Shape what leaves `iface`: rate, optional delay (needs netem), loss.

    HTB class 1:10 carries traffic at the rate; class 1:20 feeds a FIFO of
    length 0 and so drops whatever the loss filter sends it.
    """
    tc, rate = _tc(netns), f"{round(bandwidth_bps)}bit"
    limit = str(queue_packets(bandwidth_bps))
    htb_class = ["htb", "rate", rate, "ceil", rate, "quantum", str(_MTU_FRAME)]
    queue = (
        ["netem", "delay", f"{latency_ms:g}ms", "limit", limit]
        if netem and latency_ms > 0
        else ["pfifo", "limit", limit]
    )
    return [
        [*tc, "qdisc", "add", "dev", iface, "root", "handle", "1:", "htb", "default", "10"],
        [*tc, "class", "add", "dev", iface, "parent", "1:", "classid", "1:10", *htb_class],
        [*tc, "qdisc", "add", "dev", iface, "parent", "1:10", "handle", "10:", *queue],
        [*tc, "class", "add", "dev", iface, "parent", "1:", "classid", "1:20", *htb_class],
        [
            *tc,
            "qdisc",
            "add",
            "dev",
            iface,
            "parent",
            "1:20",
            "handle",
            "20:",
            "pfifo",
            "limit",
            "0",
        ],
        *loss_commands(iface, netns, loss_pct),
    ]


def link_commands(
    tag: str,
    index: int,
    device: str,
    bandwidth_bps: float,
    latency_ms: float,
    loss_pct: float,
    netem: bool,
) -> list[Cmd]:
    """Shape both ends of device `index`'s link: its uplink in the namespace, downlink outside."""
    args = (bandwidth_bps, latency_ms, loss_pct, netem)
    return [
        *shaping_commands(NS_IFACE, netns_name(tag, device), *args),
        *shaping_commands(host_veth(tag, index), None, *args),
    ]


def link_state_commands(netns: str, up: bool) -> list[Cmd]:
    """Set a device's end of its link (``eth0`` in `netns`) administratively up or down.

    Down, the kernel drops what the device sends and its veth peer loses carrier;
    the device's address stays, and its connected route comes back when it is up.
    """
    return [["ip", "-n", netns, "link", "set", NS_IFACE, "up" if up else "down"]]


def link_is_up(netns: str) -> bool:
    """Whether ``eth0`` in `netns` is administratively up (its flags carry UP)."""
    out = run(["ip", "-n", netns, "-o", "link", "show", NS_IFACE])
    flags = re.search(r"<([^>]*)>", out)
    return flags is not None and "UP" in flags.group(1).split(",")


def delete_commands(netns: Sequence[str], links: Sequence[str]) -> list[Cmd]:
    """Delete namespaces (their veth ends, and so the pairs, go with them), links, bridges last."""
    ordered = sorted(links, key=lambda n: (n.startswith("aebr-"), n))
    return [
        *(["ip", "netns", "del", ns] for ns in netns),
        *(["ip", "link", "del", link] for link in ordered),
    ]


def run(cmd: Cmd, check: bool = True, timeout_s: float = 30.0) -> str:
    """Run one command; its stdout, or NetError with the command and stderr when `check`."""
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise NetError(f"`{' '.join(cmd)}` failed: {exc}") from exc
        return ""
    if check and out.returncode != 0:
        raise NetError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def run_all(cmds: Sequence[Cmd]) -> None:
    """Run commands in order, stopping at the first failure (NetError)."""
    for cmd in cmds:
        run(cmd)


def list_netns() -> list[str]:
    """Names of every network namespace `ip netns` knows."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def list_links() -> dict[str, str]:
    """Every link of the root namespace -> the namespace its veth peer is in ("" if none)."""
    links = {}
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            peer = re.search(r"link-netns (\S+)", parts[2])
            links[parts[1].strip().split("@", 1)[0]] = peer.group(1) if peer else ""
    return links


def netns_pids(netns: str) -> list[int]:
    """Processes running inside namespace `netns`."""
    out = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def overlaps(subnet: str) -> list[str]:
    """Addresses and routes of the root namespace that overlap `subnet` (the default excluded).

    A testbed must not shadow a network this machine already reaches, nor
    share a subnet with another testbed.
    """
    net = ipaddress.IPv4Network(subnet)
    found = []
    for line in run(["ip", "-o", "-4", "addr", "show"]).splitlines():
        parts = line.split()
        if "inet" in parts:
            iface = ipaddress.IPv4Interface(parts[parts.index("inet") + 1])
            if iface.network.overlaps(net):
                found.append(f"{iface} on {parts[1]}")
    for line in run(["ip", "-4", "route", "show"]).splitlines():
        dest = line.split()[0] if line.split() else "default"
        with contextlib.suppress(ValueError):
            if dest != "default" and ipaddress.IPv4Network(dest, strict=False).overlaps(net):
                found.append(f"route {line.strip()}")
    return found


def loss_of_bytecode(code: str) -> float | None:
    """The loss percent `drop_bytecode` encoded in `code`, None for other programs."""
    if code == drop_bytecode(0):
        return 0.0
    if code == drop_bytecode(100):
        return 100.0
    m = re.fullmatch(rf"4,32 0 0 {_SKF_AD_RANDOM},53 1 0 (\d+),6 0 0 {_MATCH},6 0 0 0", code)
    return int(m.group(1)) / 2**32 * 100 if m else None


def link_summary(iface: str, netns: str | None) -> str:
    """How `iface` shapes what it sends, e.g. "100Mbit, loss 0%" or "100Mbit, CUT"."""
    tc = _tc(netns)
    classes = run([*tc, "class", "show", "dev", iface], check=False)
    rate = re.search(r"class htb 1:10 .*?rate (\S+)", classes)
    parts = [rate.group(1) if rate else "unshaped"]
    delay = re.search(
        r"netem .*?delay (\S+)", run([*tc, "qdisc", "show", "dev", iface], check=False)
    )
    if delay:
        parts.append(f"delay {delay.group(1)}")
    code = re.search(r"bytecode '([^']*)'", run([*tc, "filter", "show", "dev", iface], check=False))
    loss = loss_of_bytecode(code.group(1)) if code else None
    if loss is not None:
        parts.append("CUT" if loss >= 100 else f"loss {loss:.3g}%")
    return ", ".join(parts)


def netem_available(iface: str) -> bool:
    """Whether the kernel has the netem queue (latency), tried on our own `iface`."""
    probe = ["tc", "qdisc", "add", "dev", iface, "root", "handle", "9:", "netem", "delay", "1ms"]
    if subprocess.run(probe, capture_output=True, stdin=subprocess.DEVNULL).returncode != 0:
        return False
    run(["tc", "qdisc", "del", "dev", iface, "root"], check=False)
    return True
