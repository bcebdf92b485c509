"""ZeroMQ socket helpers: consistent options and timeouts for every service.

Every socket gets LINGER=0 (a dead peer never blocks shutdown) and receiving
sockets get MAXMSGSIZE so ZeroMQ itself drops a peer that sends an absurd frame.
"""

from __future__ import annotations

from typing import Any

import zmq

from common.codec import Limits

__all__ = ["bind_router", "connect_dealer", "poll_in"]


def bind_router(ctx: zmq.Context[Any], addr: str, limits: Limits) -> tuple[zmq.Socket[Any], str]:
    """A ROUTER bound to `addr` (port 0 or * picks a free one); returns it and its endpoint."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_tensor_bytes + limits.max_header_bytes)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its identity
    if addr.endswith(":0"):
        addr = addr[:-2] + ":*"
    sock.bind(addr)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, endpoint


def connect_dealer(
    ctx: zmq.Context[Any], addr: str, identity: str, send_timeout_s: float = 30.0
) -> zmq.Socket[Any]:
    """A DEALER with routing identity `identity`, connected to `addr`."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(addr)
    return sock


def poll_in(sock: zmq.Socket[Any], timeout_s: float) -> bool:
    """True when `sock` has a message within `timeout_s`."""
    return bool(sock.poll(int(timeout_s * 1000), zmq.POLLIN))
