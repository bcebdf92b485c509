"""A free TCP port to bind a service to, chosen where outgoing connections never land.

Binding port 0 and handing the number on races: the kernel gives a port from the
ephemeral range, the probe socket closes, and before the service binds it a
client's `connect()` (to Redis, to a peer) may take that same number as its local
port, so the service fails with "address in use". Ports below the kernel's
ephemeral range are never picked by `connect()`, so a port found free there stays
free unless another service binds it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port on `host` nobody listens on, below the ephemeral range, not handed out before."""
    top = max(_LOWEST + 1000, _ephemeral_start())
    for _ in range(attempts):
        port = random.randrange(_LOWEST, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port on {host} in {_LOWEST}..{top} after {attempts} tries")
