"""Emulated devices reachable over a real ssh path: a namespace and an sshd each.

Each device is a network namespace on a bridge of its own, running its own
`sshd -D -f CONFIG` bound to the namespace's address, with host keys and one
authorized client key made here by ssh-keygen; the client checks host keys
strictly against a known_hosts file written here. A device's docker CLI
reaches this machine's engine through /var/run/docker.sock (a unix socket,
which network namespaces do not separate), so containers a deploy starts run
on this engine, and with ``--network host`` in the root namespace, where the
bridge's address is the coordinator's.

Names are not the testbed's (``aed-``/``aedbr-``/``aedv-``), so its cleanup
of leftovers never takes these away mid-test; `down` removes everything by
this run's tag, and is safe to call twice or after a failed `up`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from common.procs import spawn, stop_all

SSHD = "/usr/sbin/sshd"
COMMENT = "asteroid-deploytest-"


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def free_subnet() -> str:
    """A /24 in 10.78.0.0/16 that no address or route of this machine overlaps."""
    used = [
        ipaddress.IPv4Interface(p.split()[3]).network
        for p in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines()
        if len(p.split()) > 3
    ]
    for line in _run(["ip", "-4", "route", "show"]).stdout.splitlines():
        with contextlib.suppress(ValueError, IndexError):
            used.append(ipaddress.IPv4Network(line.split()[0], strict=False))
    for third in random.sample(range(10, 250), 240):
        net = ipaddress.IPv4Network(f"10.78.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise RuntimeError("no free 10.78.x.0/24 subnet")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class SshDevices:
    """Devices `names` behind sshd in namespaces; `up` builds them, `down` removes them."""

    def __init__(self, names: list[str], workdir: Path, tag: str) -> None:
        self.names, self.dir, self.tag = names, workdir, tag
        self.subnet = free_subnet()
        hosts = list(ipaddress.IPv4Network(self.subnet).hosts())
        self.bridge_ip = str(hosts[0])
        self.addresses = {n: str(hosts[10 + i]) for i, n in enumerate(names)}
        self.bridge = f"aedbr-{tag}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client_key = workdir / "client_ed25519"
        self.known_hosts = workdir / "known_hosts"
        self._rule: list[str] | None = None
        self._made_run_sshd = False
        self.pids: list[int] = []

    def netns(self, name: str) -> str:
        return f"aed-{self.tag}-{name}"

    def _veth(self, i: int) -> str:
        return f"aedv-{self.tag}-{i}"

    def up(self, timeout_s: float = 30.0) -> SshDevices:
        try:
            self._build(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _build(self, timeout_s: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        prefix = ipaddress.IPv4Network(self.subnet).prefixlen
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_ip}/{prefix}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        if shutil.which("iptables"):
            # Docker's FORWARD policy DROP would cut bridged frames between devices
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-m", "comment"]
            rule += ["--comment", COMMENT + self.tag, "-j", "ACCEPT"]
            _run(["iptables", "-I", *rule])
            self._rule = rule
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.client_key)])
        authorized = self.dir / "authorized_keys"
        shutil.copy(f"{self.client_key}.pub", authorized)
        if not Path("/run/sshd").exists():  # sshd's privilege-separation directory
            Path("/run/sshd").mkdir(mode=0o755)
            self._made_run_sshd = True
        known = []
        for i, name in enumerate(self.names):
            ns, veth, addr = self.netns(name), self._veth(i), self.addresses[name]
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            host_key = self.dir / f"host_{name}_ed25519"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
            known.append(
                f"{addr} {Path(f'{host_key}.pub').read_text().split()[0]} "
                f"{Path(f'{host_key}.pub').read_text().split()[1]}"
            )
            config = self.dir / f"sshd_{name}.conf"
            config.write_text(
                "\n".join(
                    [
                        f"ListenAddress {addr}:22",
                        f"HostKey {host_key}",
                        f"AuthorizedKeysFile {authorized}",
                        "PidFile none",
                        "PermitRootLogin prohibit-password",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "StrictModes no",
                        "PrintMotd no",
                        "X11Forwarding no",
                        "AllowTcpForwarding no",
                        "",
                    ]
                )
            )
            cmd = ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)]
            self.procs[name] = spawn(cmd, dict(os.environ), self.dir / f"sshd_{name}.log")
            self.pids.append(self.procs[name].pid)
        self.known_hosts.write_text("\n".join(known) + "\n")
        for name in self.names:
            self._wait_listening(name, timeout_s)

    def _wait_listening(self, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.procs[name].poll() is not None:
                log = (self.dir / f"sshd_{name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of {name} exited: {log[-800:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.addresses[name], 22), timeout=1.0),
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {name} did not listen within {timeout_s:.0f} s")
            time.sleep(0.1)

    def down(self) -> None:
        """Stop every sshd, delete namespaces, links and the FORWARD rule (idempotent)."""
        stop_all(list(self.procs.values()), timeout_s=5.0)
        self.procs.clear()
        for name in self.names:
            _run(["ip", "netns", "del", self.netns(name)], check=False)
        for i in range(len(self.names)):
            _run(["ip", "link", "del", self._veth(i)], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        if self._rule is not None:
            _run(["iptables", "-D", *self._rule], check=False)
            self._rule = None
        if self._made_run_sshd:
            with contextlib.suppress(OSError):
                Path("/run/sshd").rmdir()
            self._made_run_sshd = False

    def leftovers(self) -> list[str]:
        """Anything of this tag still on the machine: namespaces, links, rules, sshd processes."""
        found = [n for n in _run(["ip", "netns", "list"]).stdout.split() if f"-{self.tag}-" in n]
        found += [
            line.split(":")[1].strip()
            for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines()
            if self.tag in line.split(":")[1]
        ]
        if shutil.which("iptables"):
            rules = _run(["iptables", "-S", "FORWARD"], check=False).stdout.splitlines()
            found += [r for r in rules if COMMENT + self.tag in r]
        found += [f"pid {p.pid}" for p in self.procs.values() if p.poll() is None]
        return found

    def __enter__(self) -> SshDevices:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()
