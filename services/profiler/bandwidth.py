"""Device-to-device bandwidth, measured the way the data plane moves tensors.

A prober streams `count` messages of `nbytes` to a `BandwidthSink` over what a
worker's `Dispatcher` and `Receiver` use: a DEALER from `connect_dealer` to a
ROUTER from `bind_router`, each message a small msgpack header frame plus one
raw payload frame sent without a copy and received without one. The sink
acknowledges the last message, so the prober's clock covers every byte.

The probe speaks a private header (not the `common.messages` union) so that a
bandwidth sink never mixes with a worker's task pool. A handshake first makes
sure the sink is there and measures the round trip; every wait has a deadline.

With CURVE keys (`common.curve`) the probe is secured like the data plane it
measures, and so also measures the encryption's cost: the sink is a CURVE
server with its worker's own pair and admits only worker keys of the set, and
the prober is a CURVE client with its own pair and the sink worker's public
key. A prober without an admitted key is refused at the handshake, so it hears
nothing and fails with BandwidthError at its deadline.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.codec import Limits
from common.curve import CurveKeys
from common.errors import AsteroidError
from common.logging import get_logger
from common.sockets import bind_router, connect_dealer, poll_in

__all__ = ["BandwidthError", "BandwidthSink", "LinkProbe", "probe_bandwidth", "probe_link"]

log = get_logger(__name__)

MAX_COUNT = 1_000_000
MAX_PROBES = 64  # probes a sink tracks at once; a flood of hellos cannot grow it further


class BandwidthError(AsteroidError, TimeoutError):
    """A bandwidth probe got no (or no valid) answer from the sink in time."""


class _Header(BaseModel):
    """The probe's one header: ``hello`` -> ``ready``, ``data`` x count -> ``done``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = 1
    kind: Literal["hello", "ready", "data", "done"]
    probe: str = Field(min_length=1, max_length=64)
    count: int = Field(0, ge=0, le=MAX_COUNT)
    nbytes: int = Field(0, ge=0)
    seq: int = Field(0, ge=0)


def _pack(header: _Header) -> bytes:
    return bytes(msgpack.packb(header.model_dump(), use_bin_type=True))


def _unpack(raw: bytes, limits: Limits) -> _Header:
    """Decode a header frame; ValueError says what is wrong with it."""
    if len(raw) > limits.max_header_bytes:
        raise ValueError(f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"undecodable header ({type(exc).__name__})") from exc
    if not isinstance(body, dict):
        raise ValueError(f"header is a {type(body).__name__}, not a map")
    try:
        return _Header.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{first['msg']} at {'.'.join(map(str, first['loc']))}") from exc


@dataclass
class _Stream:
    count: int
    nbytes: int
    started: float
    received: int = 0


class BandwidthSink(threading.Thread):
    """A ROUTER that counts probe messages and acknowledges each completed probe.

    Run it on a device (a worker can start one beside its data socket) and give
    its `endpoint` to probers. A malformed frame is logged with its sender and
    dropped; probes unfinished after `stale_s` are forgotten.

    With `keys` (the device's worker pair) it is a CURVE server admitting keys
    of the set in `roles`, as the worker's data socket is, and takes a message
    only under a routing identity of its key's name ("NAME/..."), so one
    admitted prober cannot pose as another.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind: str = "tcp://127.0.0.1:0",
        limits: Limits | None = None,
        stale_s: float = 60.0,
        keys: CurveKeys | None = None,
        roles: Iterable[str] = ("worker",),
    ) -> None:
        super().__init__(name="bandwidth-sink", daemon=True)
        self.limits = limits or Limits()
        self._sock, self.endpoint = bind_router(ctx, bind, self.limits, keys=keys, roles=roles)
        self._curve = keys is not None
        self.stale_s = stale_s
        self.stop = threading.Event()
        self.bad_messages = 0
        self._streams: dict[tuple[bytes, str], _Stream] = {}

    def __enter__(self) -> BandwidthSink:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop receiving and wait (bounded) for the thread."""
        self.stop.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        """Serve probes until stopped; never dies on a bad message."""
        try:
            while not self.stop.is_set():
                if poll_in(self._sock, 0.1):
                    self._receive()
                self._forget_stale()
        finally:
            self._sock.close(0)

    def _receive(self) -> None:
        frames = self._sock.recv_multipart(copy=False)
        route = bytes(frames[0].bytes)
        peer = route.decode(errors="replace")
        try:
            if len(frames) not in (2, 3):
                raise ValueError(f"{len(frames) - 1} frames after the route, expected 1 or 2")
            if self._curve:
                _check_user(frames[1], peer)
            header = _unpack(frames[1].bytes, self.limits)
            payload = len(frames[2].buffer) if len(frames) == 3 else 0
            reply = self._handle(route, header, payload)
        except ValueError as exc:
            self.bad_messages += 1
            log.warning("dropped bad bandwidth probe message", peer=peer, reason=str(exc))
            return
        if reply is not None:
            self._sock.send_multipart([route, _pack(reply)])

    def _handle(self, route: bytes, h: _Header, payload: int) -> _Header | None:
        key = (route, h.probe)
        if h.kind == "hello":
            if key not in self._streams and len(self._streams) >= MAX_PROBES:
                raise ValueError(f"already tracking {MAX_PROBES} probes")
            self._streams[key] = _Stream(h.count, h.nbytes, time.monotonic())
            return _Header(kind="ready", probe=h.probe, count=h.count, nbytes=h.nbytes)
        if h.kind != "data":
            raise ValueError(f"a sink does not take {h.kind!r} messages")
        stream = self._streams.get(key)
        if stream is None:
            raise ValueError(f"data of probe {h.probe!r} without a hello")
        if payload != stream.nbytes:
            raise ValueError(f"payload of {payload} bytes, probe announced {stream.nbytes}")
        stream.received += 1
        if stream.received < stream.count:
            return None
        del self._streams[key]
        return _Header(
            kind="done", probe=h.probe, count=stream.received, nbytes=stream.nbytes * stream.count
        )

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._streams.items() if now - s.started > self.stale_s]:
            del self._streams[key]


def _check_user(frame: zmq.Frame, peer: str) -> None:
    """ValueError unless `peer` is the name (or "NAME/...") of the key that sent `frame`.

    The ZAP handler proved the key; the routing identity is only claimed.
    """
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        user = ""
    _, _, name = (user if isinstance(user, str) else "").partition(":")
    if not name:
        raise ValueError("CURVE message without an authenticated key (no User-Id)")
    if peer != name and not peer.startswith(name + "/"):
        raise ValueError(f"routing identity {peer!r} differs from its key's name {name!r}")


@dataclass(frozen=True)
class LinkProbe:
    """What one probe measured.

    Attributes:
        mb_per_s: Payload megabytes (1e6 bytes) per second, from the first send to
            the sink's acknowledgement (so it includes one round trip).
        rtt_s: Round trip of the handshake (an empty message and its reply).
        nbytes: Payload bytes of each message.
        count: Messages sent.

    """

    mb_per_s: float
    rtt_s: float
    nbytes: int
    count: int

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in the unit `ClusterSpec` uses."""
        return self.mb_per_s * 1e6


def _await(
    sock: zmq.Socket[Any], want: _Header, deadline: float, addr: str, timeout_s: float
) -> _Header:
    """The reply of kind `want.kind` for `want.probe`, or BandwidthError at `deadline`."""
    limits = Limits()
    while (left := deadline - time.monotonic()) > 0:
        if not poll_in(sock, left):
            break
        raw = sock.recv()
        while sock.getsockopt(zmq.RCVMORE):  # a reply is one frame; drop any extra
            sock.recv()
        try:
            got = _unpack(raw, limits)
        except ValueError as exc:
            raise BandwidthError(f"bandwidth sink at {addr} sent a bad reply: {exc}") from exc
        if got.kind == want.kind and got.probe == want.probe:
            return got
    raise BandwidthError(
        f"no {want.kind!r} reply from a bandwidth sink at {addr} within the probe's "
        f"{timeout_s} s (is a sink running there, and does it admit this prober's key?)"
    )


def probe_link(
    ctx: zmq.Context[Any],
    peer_addr: str,
    nbytes: int = 1 << 20,
    count: int = 32,
    timeout_s: float = 10.0,
    keys: CurveKeys | None = None,
    sink: str | None = None,
) -> LinkProbe:
    """Stream `count` messages of `nbytes` to the sink at `peer_addr` and time them.

    `timeout_s` bounds the whole probe: handshake, sending and acknowledgement.
    With `keys` (the prober's own pair) the probe is a CURVE client of the sink
    run by worker `sink`, whose public key it takes from the key set.

    Raises:
        BandwidthError: No sink answered (none runs there, or it refused this
            prober's key), or it did not acknowledge every message in time, or
            it answered nonsense.
        ConfigError: `sink` has no public key in the key set.
        ValueError: `nbytes`, `count` or `timeout_s` out of range, or `keys`
            without `sink`.

    """
    if nbytes < 1 or not 1 <= count <= MAX_COUNT or timeout_s <= 0:
        raise ValueError(
            f"need nbytes >= 1, 1 <= count <= {MAX_COUNT} and timeout_s > 0, "
            f"got {nbytes}, {count} and {timeout_s}"
        )
    if keys is not None and sink is None:
        raise ValueError(f"a CURVE probe of {peer_addr} needs the name of the sink's worker")
    server_key = keys.server_key("worker", sink) if keys is not None and sink else None
    deadline = time.monotonic() + timeout_s
    probe = uuid.uuid4().hex[:16]
    # under CURVE the identity must be the key's name, one session of it per probe
    identity = f"{keys.name}/bw-{probe}" if keys is not None else f"bw-{probe}"
    sock = connect_dealer(
        ctx, peer_addr, identity, send_timeout_s=timeout_s, keys=keys, server_key=server_key
    )
    try:
        hello = _Header(kind="hello", probe=probe, count=count, nbytes=nbytes)
        t0 = time.perf_counter()
        sock.send(_pack(hello))
        _await(sock, _Header(kind="ready", probe=probe), deadline, peer_addr, timeout_s)
        rtt = time.perf_counter() - t0
        payload = memoryview(bytearray(nbytes))
        t0 = time.perf_counter()
        for seq in range(count):
            header = _pack(_Header(kind="data", probe=probe, seq=seq))
            sock.send_multipart([header, payload], copy=False)
        done = _await(sock, _Header(kind="done", probe=probe), deadline, peer_addr, timeout_s)
        elapsed = time.perf_counter() - t0
    except zmq.Again as exc:
        raise BandwidthError(f"could not send to {peer_addr} within {timeout_s} s") from exc
    finally:
        sock.close(0)
    if done.count != count or done.nbytes != count * nbytes:
        raise BandwidthError(
            f"sink at {peer_addr} acknowledged {done.count} messages of {done.nbytes} bytes "
            f"in all, expected {count} of {count * nbytes}"
        )
    return LinkProbe(count * nbytes / elapsed / 1e6, rtt, nbytes, count)


def probe_bandwidth(
    ctx: zmq.Context[Any],
    peer_addr: str,
    nbytes: int = 1 << 20,
    count: int = 32,
    timeout_s: float = 10.0,
    keys: CurveKeys | None = None,
    sink: str | None = None,
) -> float:
    """Megabytes (1e6 bytes) per second to the sink at `peer_addr`; see `probe_link`."""
    return probe_link(ctx, peer_addr, nbytes, count, timeout_s, keys, sink).mb_per_s
