"""Is anything still listening on a device's data port? One TCP connect, off the loop.

A closed control connection is either a link that flapped (it comes back within
the flap grace) or a process that died. The two look alike on the control
socket, but not on the device's data port: a dead worker's kernel answers a
connect to its port with a refusal (RST) at once, which no link fault produces
(a cut link gives a timeout or an unreachable network, never a refusal from the
device itself). So when its control connection closes, the loop asks
`PortChecks.check` to connect once to the device's advertised data address;
only a refusal comes back (`take`), as evidence for the core
(`core.Refused`). Anything else — a timeout, an unreachable host, a connect
that succeeds — is no evidence, and the grace decides as before.

The connect runs on a short-lived daemon thread so the loop never blocks on it
(name resolution included); the socket closes at once and nothing is sent, so
under CURVE the peer's ZeroMQ simply drops a handshake that never starts. At
most one check per device and `MAX_IN_FLIGHT` in all are under way; results
wait in a bounded queue.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from common.ids import DeviceId
from common.logging import get_logger

__all__ = ["CHECK_TIMEOUT_S", "MAX_IN_FLIGHT", "PortChecks", "host_port", "refused"]

log = get_logger(__name__)
CHECK_TIMEOUT_S = 0.25
"""How long one connect may take: a refusal from a live host comes within a round trip."""
MAX_IN_FLIGHT = 64
"""Checks under way at once; a closed connection beyond it is judged by the grace alone."""


def host_port(addr: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://host:port` address (IPv6 in brackets), or None if it is not one."""
    if not addr.startswith("tcp://"):
        return None
    host, sep, port = addr[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not host or host == "*":
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = int(port)
    return (host, number) if 0 < number < 65536 else None


def refused(host: str, port: int, timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """True only if a TCP connect to (host, port) was actively refused (nothing listens).

    A timeout, an unreachable network or a connect that succeeds all say
    nothing about the process, so they are False. The socket closes at once.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, UnicodeError):
        return False


class PortChecks:
    """The data-port checks of devices whose control connection closed, and their refusals."""

    def __init__(
        self,
        timeout_s: float = CHECK_TIMEOUT_S,
        probe: Callable[[str, int, float], bool] = refused,
    ) -> None:
        self.timeout_s, self._probe = timeout_s, probe
        self._lock = threading.Lock()
        self._in_flight: set[DeviceId] = set()
        self._refused: deque[tuple[DeviceId, float]] = deque(maxlen=MAX_IN_FLIGHT)

    def check(self, device: DeviceId, data_addr: str) -> bool:
        """Start a check of `device`'s `data_addr`; False if none started (busy, or no address)."""
        target = host_port(data_addr)
        if target is None:
            return False
        with self._lock:
            if device in self._in_flight or len(self._in_flight) >= MAX_IN_FLIGHT:
                return False
            self._in_flight.add(device)
        at = time.monotonic()  # after the close: a refusal from now on is about the dead process
        thread = threading.Thread(
            target=self._run, args=(device, target, at), name="port-check", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the grace decides
            with self._lock:
                self._in_flight.discard(device)
            return False
        return True

    def _run(self, device: DeviceId, target: tuple[str, int], at: float) -> None:
        try:
            hit = self._probe(target[0], target[1], self.timeout_s)
        except Exception:  # a check must never take the coordinator down
            log.exception("data port check failed", device=device)
            hit = False
        with self._lock:
            self._in_flight.discard(device)
            if hit:
                self._refused.append((device, at))

    def take(self) -> list[tuple[DeviceId, float]]:
        """The refusals seen since the last call: (device, when its check began)."""
        with self._lock:
            out = list(self._refused)
            self._refused.clear()
        return out

    def busy(self) -> int:
        """Checks under way."""
        with self._lock:
            return len(self._in_flight)
