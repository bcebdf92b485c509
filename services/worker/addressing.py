"""Where a worker's data-plane socket binds and the address peers use to reach it.

So that a worker on another machine needs only the coordinator's address:
with a loopback coordinator everything stays on loopback; otherwise the
socket binds to every interface and advertises the address of the interface
that routes to the coordinator (found by the kernel's routing table, without
sending a packet).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from common.errors import ConfigError

__all__ = ["data_hosts", "route_address"]

_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _coordinator_host(coordinator: str) -> str:
    host = urlsplit(coordinator).hostname
    if not host:
        raise ConfigError(f"coordinator: {coordinator!r} is not an address like tcp://HOST:PORT")
    return host


def route_address(host: str) -> str:
    """The local address the kernel would use to reach `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
        except OSError as exc:
            raise ConfigError(
                f"no route to the coordinator host {host!r}: {exc}; set --advertise-host"
            ) from exc
        return str(s.getsockname()[0])


def data_hosts(data_host: str, advertise_host: str, coordinator: str) -> tuple[str, str]:
    """(interface to bind, host to advertise) from the settings, filling in the blanks."""
    target = _coordinator_host(coordinator)
    bind = data_host or ("127.0.0.1" if _is_loopback(target) else "0.0.0.0")
    if advertise_host:
        return bind, advertise_host
    if bind not in ("0.0.0.0", "*"):
        return bind, bind
    return bind, route_address(target)
