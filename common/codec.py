"""The one wire codec: msgpack header frame, then raw tensor frames.

Sending hands tensor memory to ZeroMQ without a copy; receiving reads the
header first, checks every announced size against the limits, and only then
receives each tensor frame (large ones wrapped in place, small ones into a
fresh tensor), so a hostile header cannot make us allocate 100 GB, ZeroMQ's
MAXMSGSIZE bounds any frame, and a truncated or oversized frame is detected,
drained and reported.

torch is imported only when a message carries tensors: the CLI's requests and
replies carry none, and a command that only asks a coordinator something should
start in a fraction of a second, not wait seconds for torch.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import msgpack
import zmq
from pydantic import ValidationError

from common.errors import ProtocolError
from common.messages import PROTOCOL_VERSION, Message, message_adapter

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "NONCE_HEX",
    "Envelope",
    "Limits",
    "encode",
    "peer_of_route",
    "recv_message",
    "send_message",
]

DTYPES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "bool": 1,
}
"""The dtypes a tensor frame may have, by wire name, with their bytes per element."""
_IDS = itertools.count(1)
ZERO_COPY_MIN_BYTES = 64 << 10
NONCE_HEX = 16
"""Hex digits of the random nonce that ends every routing identity (`peer_of_route`)."""
_ROUTE = re.compile(rf"(?P<peer>[^\x00-\x1f\x7f\ufffd]{{1,200}})/[0-9a-f]{{{NONCE_HEX}}}")
"""A routing identity: printable UTF-8, then the nonce."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what a receiver accepts."""

    max_header_bytes: int = 1 << 20
    max_tensor_bytes: int = 1 << 30
    max_tensors: int = 16
    max_dims: int = 8


@dataclass
class Envelope:
    """A decoded message with its envelope fields and tensors."""

    msg: Message
    sender: str
    msg_id: int
    sent_at: float
    tensors: list[torch.Tensor] = field(default_factory=list)
    user: str = ""
    """"ROLE:NAME" of the CURVE key that sent it (routed receive on a CURVE server), else ""."""
    fence: int = 0
    """The sending coordinator's fencing epoch (raised at each coordinator start; 0: none)."""
    route: bytes = b""
    """The ROUTER's routing identity of the connection it came on (routed receive), which
    replies go to; `peer` is this without its nonce."""
    fd: int = -1
    """The file descriptor of the TCP connection it came on (routed receive; -1: none, as on
    inproc): a socket monitor names a closed connection by it."""


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of each wire name (imports torch: called only for tensor frames)."""
    import torch

    return {name: getattr(torch, name) for name in DTYPES}


@cache
def _wire_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def _raw(t: torch.Tensor) -> memoryview:
    """Bytes of a contiguous CPU tensor as a memoryview, without a copy."""
    flat = t.detach().contiguous().reshape(-1)
    return _bytes_of(flat)


def _bytes_of(flat: torch.Tensor) -> memoryview:
    """A writable byte view of a 1-D contiguous tensor's memory."""
    import torch

    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def encode(
    msg: Message, sender: str, tensors: Sequence[torch.Tensor] = (), fence: int = 0
) -> list[Any]:
    """Frames for one message: the msgpack header, then one raw frame per tensor.

    A coordinator stamps its commands with its `fence`, so that workers refuse
    those of a coordinator that was replaced.
    """
    metas = []
    bufs = []
    for t in tensors:
        name = _wire_names().get(t.dtype)
        if name is None:
            raise ProtocolError(f"cannot send dtype {t.dtype}", sender)
        buf = _raw(t)
        metas.append([name, list(t.shape), buf.nbytes])
        bufs.append(buf)
    header = {
        "v": PROTOCOL_VERSION,
        "sender": sender,
        "id": next(_IDS),
        "t": time.time(),
        "msg": msg.model_dump(mode="json"),
        "tensors": metas,
    }
    if fence:
        header["fence"] = fence
    return [msgpack.packb(header, use_bin_type=True), *bufs]


def send_message(
    sock: zmq.Socket[Any],
    msg: Message,
    sender: str,
    tensors: Sequence[torch.Tensor] = (),
    route: bytes | None = None,
    fence: int = 0,
) -> None:
    """Send one message; tensors go zero-copy (the tensor must not change until sent)."""
    frames = encode(msg, sender, tensors, fence)
    if route is not None:
        frames.insert(0, route)
    sock.send_multipart(frames, copy=False)


def _drain(sock: zmq.Socket[Any]) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv_into(bytearray())


def _parse_header(raw: bytes, peer: str, limits: Limits) -> tuple[dict[str, Any], Message]:
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}", peer)
    try:
        header = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable header ({type(exc).__name__}: {exc})", peer) from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map", peer)
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} not supported (this side speaks {PROTOCOL_VERSION})",
            peer,
        )
    body = header.get("msg")
    if not isinstance(body, dict):
        raise ProtocolError("header has no message body", peer)
    try:
        msg = message_adapter.validate_python(body)
    except ValidationError as exc:
        kind = body.get("type", "?")
        first = exc.errors()[0]
        raise ProtocolError(
            f"invalid {str(kind)[:40]!r} message: {first['msg']} "
            f"at {'.'.join(map(str, first['loc']))[:120]}",
            peer,
            kind if isinstance(kind, str) else None,
        ) from exc
    return header, msg


def _describe(meta: Any, peer: str, limits: Limits) -> tuple[str, list[int], int]:
    """Check a header's tensor descriptor: known dtype, sane shape, bounded size."""
    if not (isinstance(meta, list) and len(meta) == 3):
        raise ProtocolError(f"bad tensor descriptor {str(meta)[:80]}", peer)
    name, shape, nbytes = meta
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unknown tensor dtype {str(name)[:40]!r}", peer)
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_dims
        or not all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"bad tensor shape {str(shape)[:80]}", peer)
    itemsize = DTYPES[name]
    expected = math.prod(shape) * itemsize
    if not isinstance(nbytes, int) or nbytes != expected:
        raise ProtocolError(f"tensor of shape {shape} {name} announces {nbytes!r} bytes", peer)
    # An empty tensor's other dimensions still set its strides: bounded like its bytes,
    # so that no announced shape makes torch overflow.
    span = math.prod(max(d, 1) for d in shape) * itemsize
    if max(nbytes, span) > limits.max_tensor_bytes:
        raise ProtocolError(
            f"tensor of shape {shape} {name} ({nbytes} bytes) exceeds the limit of "
            f"{limits.max_tensor_bytes} bytes",
            peer,
        )
    return name, shape, nbytes


def _recv_tensor(
    sock: zmq.Socket[Any], name: str, shape: list[int], nbytes: int, peer: str
) -> torch.Tensor:
    """Receive one tensor frame of exactly `nbytes`.

    Large frames are wrapped in place (ZeroMQ already holds them in memory of
    their own, so copying again would halve throughput); small ones are
    received into a fresh tensor, which also guarantees alignment.
    """
    import torch

    dtype = _torch_dtypes()[name]
    if nbytes >= ZERO_COPY_MIN_BYTES:
        frame = sock.recv(copy=False)
        got = len(frame.buffer)
        if got == nbytes:
            return torch.frombuffer(frame.buffer, dtype=dtype).view(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
        got = sock.recv_into(_bytes_of(tensor.reshape(-1)))
        if got == nbytes:
            return tensor
    raise ProtocolError(f"tensor frame of {got} bytes, expected {nbytes}", peer)


def recv_message(
    sock: zmq.Socket[Any], limits: Limits, routed: bool = False
) -> tuple[str, Envelope]:
    """Receive one whole message (the caller has polled): (peer, envelope).

    On a ROUTER socket `peer` is the routing identity without its nonce
    (`peer_of_route`) and the envelope's `route` the whole identity; elsewhere
    `peer` is the claimed sender. Raises ProtocolError naming the peer; the rest
    of a bad message is always drained so the next receive starts on a message
    boundary.
    """
    route = sock.recv() if routed else b""
    peer = route.decode(errors="replace") if routed else "?"
    user = ""
    try:
        if routed:
            peer = peer_of_route(route)
            if not sock.getsockopt(zmq.RCVMORE):
                raise ProtocolError("message has no header frame", peer)
        head = sock.recv(copy=False)
        if routed and sock.getsockopt(zmq.MECHANISM) == zmq.CURVE:
            user = _authenticated(head, peer)
        header, msg = _parse_header(head.bytes, peer, limits)
        fd = _source_fd(head) if routed else -1
        peer = peer if routed else str(header.get("sender", "?"))
        metas = header.get("tensors", [])
        if not isinstance(metas, list) or len(metas) > limits.max_tensors:
            raise ProtocolError(f"bad tensor list {str(metas)[:80]}", peer)
        tensors: list[torch.Tensor] = []
        for meta in metas:
            name, shape, nbytes = _describe(meta, peer, limits)
            if not sock.getsockopt(zmq.RCVMORE):
                raise ProtocolError(
                    f"header announces {len(metas)} tensors, got {len(tensors)}", peer
                )
            tensors.append(_recv_tensor(sock, name, shape, nbytes, peer))
        if sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError(f"more frames than the {len(metas)} tensors announced", peer)
    except ProtocolError as exc:
        _drain(sock)
        if exc.kind is not None:  # decoded, so its sender passed the key check
            exc.route = route
        raise
    return peer, Envelope(
        msg=msg,
        sender=str(header.get("sender", peer)),
        msg_id=int(header.get("id", 0)) if isinstance(header.get("id"), int) else 0,
        sent_at=float(header["t"]) if isinstance(header.get("t"), int | float) else 0.0,
        tensors=tensors,
        user=user,
        fence=_fence(header.get("fence", 0), peer),
        route=route,
        fd=fd,
    )


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection `frame` came on; -1 where there is none (inproc)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def peer_of_route(route: bytes) -> str:
    """The peer a routing identity names: "NAME[/SESSION]/NONCE" without its nonce.

    Every DEALER connects as NAME (or NAME/SESSION, several connections of one
    key) plus a random nonce of its own (`common.sockets.connect_dealer`). The
    nonce makes a route a secret: with ROUTER_HANDOVER on (so that a peer that
    reconnects after a cut takes back its own stale route), whoever presents a
    route's identity takes its connection over, and ZeroMQ does so before any
    key is checked; nobody but the peer and the server knows the nonce, so no
    other key, and no stranger, can name it. An identity without one (hand-made,
    or ZeroMQ's own for a peer that set none) is refused.
    """
    text = route.decode(errors="replace")
    match = _ROUTE.fullmatch(text)
    if match is None:
        raise ProtocolError(
            f"routing identity {text[:60]!r} is not NAME/NONCE ({NONCE_HEX} hex digits)",
            text[:60],
        )
    return match["peer"]


def _fence(value: object, peer: str) -> int:
    """A header's fencing epoch: a non-negative int below 2**62, else the message is bad."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ProtocolError(f"bad fence {str(value)[:40]!r}", peer)
    return value


def _authenticated(frame: zmq.Frame, peer: str) -> str:
    """The "ROLE:NAME" the ZAP handler gave the frame's key, if `peer` is that NAME.

    The routing identity is only claimed by the sender; the key is proven by
    the CURVE handshake. A peer may use its key's name as identity, or
    "NAME/SESSION" when one key has several connections (a person's CLIs).
    """
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        user = ""
    user = user if isinstance(user, str) else ""
    role, _, name = user.partition(":")
    if not role or not name:
        raise ProtocolError("CURVE message without an authenticated key (no User-Id)", peer)
    if peer != name and not peer.startswith(name + "/"):
        raise ProtocolError(
            f"routing identity {peer!r} differs from its key's name {name!r} ({role}); "
            f"expected {name!r} or {name + '/...'!r}",
            peer,
        )
    return user
