"""Hand-written ZMTP 3.0 (NULL mechanism), as an attacker speaks it: what libzmq never sends.

`endless_message` opens a TCP connection, greets as a DEALER, then sends frame
after frame with the MORE flag and never a last one; `half_open` opens
connections that send a greeting's first bytes and then nothing. Both only
talk to addresses the test itself bound on loopback.
"""

from __future__ import annotations

import socket
import struct
import time

__all__ = ["endless_message", "half_open"]

_GREETING = (
    b"\xff" + b"\x00" * 8 + b"\x7f"  # signature
    + b"\x03\x00"  # version 3.0
    + b"NULL".ljust(20, b"\x00")  # mechanism
    + b"\x00"  # as-server: no
    + b"\x00" * 31  # filler
)  # fmt: skip


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _ready(identity: bytes) -> bytes:
    body = b"\x05READY" + _property(b"Socket-Type", b"DEALER") + _property(b"Identity", identity)
    return b"\x04" + bytes([len(body)]) + body


def _connect(host: str, port: int, identity: bytes, timeout_s: float) -> socket.socket:
    """A connection that has done the ZMTP handshake as a DEALER named `identity`."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    conn.sendall(_GREETING + _ready(identity))
    got = b""
    deadline = time.monotonic() + timeout_s
    while len(got) < 64 and time.monotonic() < deadline:  # the server's greeting
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the server closed the connection during its greeting")
        got += chunk
    return conn


def endless_message(
    host: str,
    port: int,
    frames: int,
    frame_bytes: int = 4096,
    identity: bytes = b"flood/0123456789abcdef",
    timeout_s: float = 30.0,
) -> tuple[socket.socket, int]:
    """Send `frames` frames of one message, each with MORE set; (connection, frames sent).

    Stops early, without error, if the server closes the connection (the
    defence at work); the caller closes the connection it gets back.
    """
    conn = _connect(host, port, identity, timeout_s)
    frame = b"\x03" + struct.pack(">Q", frame_bytes) + b"a" * frame_bytes  # MORE | LONG
    batch = 64
    sent = 0
    try:
        while sent < frames:
            conn.sendall(frame * min(batch, frames - sent))
            sent += min(batch, frames - sent)
    except OSError:
        pass
    return conn, sent


def half_open(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections that send half a greeting and then wait (the caller closes them)."""
    conns = []
    for _ in range(count):
        conn = socket.create_connection((host, port), timeout=5)
        conn.sendall(_GREETING[:10])
        conns.append(conn)
    return conns
