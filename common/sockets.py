"""ZeroMQ socket helpers: consistent options and timeouts for every service.

Every socket gets LINGER=0 (a dead peer never blocks shutdown) and receiving
sockets get MAXMSGSIZE so ZeroMQ itself drops a peer that sends an absurd frame.
A bound ROUTER also gets a receive high-water mark: once a peer has that many
messages queued unread, ZeroMQ stops reading its connection until the service
catches up, so a flooding peer fills its own send queue and the kernel's
buffers, not the server's memory. A connection that never finishes its
handshake is closed after `HANDSHAKE_S`, and the process may hold as many open
files as its hard limit allows, so a crowd of half-open connections neither
lasts nor keeps honest peers out. What no option bounds, one endless multipart
message, `common.inbound` bounds by the process's size and `reset_router`.

With `keys` (a `common.curve.CurveKeys`), a bound ROUTER is a CURVE server whose
ZAP handler admits only keys of the cluster's set in the given roles, and a
DEALER is a CURVE client of the server key it is given; see `common.curve` for
which key each socket uses. Without keys, sockets are plain (loopback only:
the coordinator refuses to bind beyond it without keys).
"""

from __future__ import annotations

import errno
import functools
import resource
import secrets
import time
from collections.abc import Iterable
from typing import Any

import zmq

from common.codec import NONCE_HEX, Limits
from common.curve import CurveKeys, start_authenticator, stop_authenticator
from common.inbound import release_freed_memory

__all__ = [
    "HANDSHAKE_S",
    "ROUTER_RCVHWM",
    "bind_router",
    "connect_dealer",
    "poll_in",
    "reset_router",
]

HANDSHAKE_S = 5.0
"""Longest a connection may take to finish its ZMTP (and CURVE) handshake: an honest
peer needs milliseconds, even across a slow link; ZeroMQ's own default is 30 s."""
BACKLOG = 1_024
"""Connections the kernel queues for accepting (ZeroMQ's default: 100)."""
REBIND_S = 5.0
"""Longest `reset_router` waits for the closed socket's port to be free again."""

ROUTER_RCVHWM = 10_000
"""Default messages a bound ROUTER queues unread per connected peer.

Far more than any honest peer has in flight (a worker's heartbeats and
replies, a pipeline's microbatches), so it never slows the protocol; a peer
past it is throttled by ZeroMQ (its connection is not read) rather than
buffered without bound.
"""


class _CurveServer(zmq.Socket[Any]):
    """A ROUTER that releases its context's ZAP handler when closed.

    The handler's sockets would otherwise keep `Context.term()` waiting.
    """

    def close(self, linger: int | None = None) -> None:
        """Close the socket, then stop the ZAP handler if no other server uses it."""
        was_open = not self.closed
        super().close(linger)
        if was_open:
            stop_authenticator(self.context)


def bind_router(
    ctx: zmq.Context[Any],
    addr: str,
    limits: Limits,
    keys: CurveKeys | None = None,
    roles: Iterable[str] = ("worker",),
    rcvhwm: int = ROUTER_RCVHWM,
) -> tuple[zmq.Socket[Any], str]:
    """A ROUTER bound to `addr` (port 0 or * picks a free one); returns it and its endpoint.

    With `keys` it is a CURVE server with that pair and admits only keys of
    the set whose role is in `roles`; a peer's User-Id frame property is then
    "ROLE:NAME". `rcvhwm` bounds the messages queued unread per peer (see
    `ROUTER_RCVHWM`); it must be positive, as 0 would mean no bound at all.
    """
    if rcvhwm < 1:
        raise ValueError(f"a ROUTER's receive high-water mark must be >= 1, got {rcvhwm}")
    _open_files_to_the_hard_limit()
    sock: zmq.Socket[Any]
    if keys is None:
        sock = ctx.socket(zmq.ROUTER)
    else:
        sock = ctx.socket(zmq.ROUTER, socket_class=_CurveServer)
        try:
            domain = start_authenticator(ctx, keys, roles)
        except BaseException:
            zmq.Socket.close(sock, 0)
            raise
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse all
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_tensor_bytes + limits.max_header_bytes)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.BACKLOG, BACKLOG)
    # a peer that reconnects (same socket, same identity) takes back its own stale route;
    # only its holder knows an identity's nonce (`common.codec.peer_of_route`)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if addr.endswith(":0"):
        addr = addr[:-2] + ":*"
    try:
        sock.bind(addr)
    except BaseException:  # the port is taken: the socket must not outlive the attempt
        sock.close(0)
        raise
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, endpoint


def reset_router(
    sock: zmq.Socket[Any],
    ctx: zmq.Context[Any],
    limits: Limits,
    keys: CurveKeys | None = None,
    roles: Iterable[str] = ("worker",),
    rcvhwm: int = ROUTER_RCVHWM,
) -> zmq.Socket[Any]:
    """Close the bound ROUTER `sock` and bind a new one (same options) at its endpoint.

    Every connection's unfinished message goes with the old socket (see
    `common.inbound`); peers' DEALERs reconnect by themselves. Waits at most
    `REBIND_S` for ZeroMQ to release the port, which it closes asynchronously.
    """
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)
    release_freed_memory()
    deadline = time.monotonic() + REBIND_S
    while True:
        try:
            return bind_router(ctx, endpoint, limits, keys, roles, rcvhwm)[0]
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@functools.cache
def _open_files_to_the_hard_limit() -> None:
    """Let this process open as many files as it may (once): each connection is one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connect_dealer(
    ctx: zmq.Context[Any],
    addr: str,
    identity: str,
    send_timeout_s: float = 30.0,
    keys: CurveKeys | None = None,
    server_key: bytes | None = None,
    monitor: int = 0,
) -> zmq.Socket[Any]:
    """A DEALER with routing identity `identity` plus a random nonce, connected to `addr`.

    The server sees the peer as `identity` and replies to the whole routing
    identity, which only this socket knows (`common.codec.peer_of_route`).
    With `keys` it is a CURVE client with that pair of the server whose public
    key is `server_key`; `identity` must then be the key's name (or
    "NAME/SESSION"), as the server refuses any other. `monitor`: the socket
    events to report on its monitor socket (`get_monitor_socket()` then returns
    it), attached before connecting so that none of the first connection's is lost.
    """
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    if keys is not None:
        if server_key is None:
            sock.close(0)
            raise ValueError(f"a CURVE client needs the server key of {addr}, got none")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"{identity}/{secrets.token_hex(NONCE_HEX // 2)}".encode())
    sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if monitor:
        sock.get_monitor_socket(monitor)
    sock.connect(addr)
    return sock


def poll_in(sock: zmq.Socket[Any], timeout_s: float) -> bool:
    """True when `sock` has a message within `timeout_s`."""
    return bool(sock.poll(int(timeout_s * 1000), zmq.POLLIN))
