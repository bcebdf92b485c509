"""Device-to-device bandwidth, measured the way the data plane moves tensors.

A prober streams `count` messages of `nbytes` to a `BandwidthSink` over what a
worker's `Dispatcher` and `Receiver` use: a DEALER from `connect_dealer` to a
ROUTER from `bind_router`, each message the project's codec frames (a msgpack
header, then one raw uint8 payload frame sent without a copy). The sink
acknowledges the last message, so the prober's clock covers every byte.

The probe speaks its own message types (LinkHello -> LinkReady, LinkData x
count -> LinkDone) to its own socket, so a bandwidth sink never mixes with a
worker's task pool. A handshake first makes sure the sink is there and
measures the round trip; every wait has a deadline.

With CURVE keys (`common.curve`) the probe is secured like the data plane it
measures, and so also measures the encryption's cost: the sink is a CURVE
server with its worker's own pair and admits only worker keys of the set, and
the prober is a CURVE client with its own pair and the sink worker's public
key. A prober without an admitted key is refused at the handshake, so it hears
nothing and fails with BandwidthError at its deadline.

It lives in `common` because both the profiler and every worker run it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import zmq

from common.codec import Envelope, Limits, recv_message, send_message
from common.curve import CurveKeys
from common.errors import AsteroidError, ProtocolError
from common.inbound import Guard
from common.logging import get_logger
from common.messages import (
    MAX_LINK_COUNT,
    MAX_LINK_MESSAGE_BYTES,
    LinkData,
    LinkDone,
    LinkHello,
    LinkReady,
    Message,
)
from common.sockets import bind_router, connect_dealer, poll_in, reset_router

__all__ = [
    "MAX_COUNT",
    "MAX_PROBES",
    "BandwidthError",
    "BandwidthSink",
    "LinkProbe",
    "probe_bandwidth",
    "probe_link",
]

log = get_logger(__name__)

MAX_COUNT = MAX_LINK_COUNT
MAX_PROBES = 64  # probes a sink tracks at once; a flood of hellos cannot grow it further
_REPLY_LIMITS = Limits(max_header_bytes=4096, max_tensor_bytes=0, max_tensors=0)
"""A sink's replies are one small header: anything bigger is not a sink's."""


class BandwidthError(AsteroidError, TimeoutError):
    """A bandwidth probe got no (or no valid) answer from the sink in time."""


@dataclass
class _Stream:
    count: int
    nbytes: int
    started: float
    received: int = 0


class BandwidthSink(threading.Thread):
    """A ROUTER that counts probe messages and acknowledges each completed probe.

    Run it on a device (each worker starts one beside its data socket) and give
    its `endpoint` to probers. A malformed or unexpected message is logged with
    its sender and dropped; probes unfinished after `stale_s` are forgotten.

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
        # one payload tensor per message, no larger than a probe may announce
        base = limits or Limits()
        self.limits = Limits(
            base.max_header_bytes,
            min(base.max_tensor_bytes, MAX_LINK_MESSAGE_BYTES),
            max_tensors=1,
            max_dims=1,
        )
        self._sock, self.endpoint = bind_router(ctx, bind, self.limits, keys=keys, roles=roles)
        self._rebind = partial(reset_router, ctx=ctx, limits=self.limits, keys=keys, roles=roles)
        self.guard: Guard | None = None
        """Set before `start` (a worker's own): the socket is reset when the process outgrows it."""
        self.stale_s = stale_s
        self.stop = threading.Event()
        self.bad_messages = 0
        self._streams: dict[tuple[str, str], _Stream] = {}

    def __enter__(self) -> BandwidthSink:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop receiving and wait (bounded) for the thread; the socket closes with it."""
        self.stop.set()
        if self.is_alive():
            self.join(timeout_s)
        elif not self._sock.closed:  # never started
            self._sock.close(0)

    def run(self) -> None:
        """Serve probes until stopped; never dies on a bad message."""
        try:
            while not self.stop.is_set():
                if self.guard is not None and self.guard.exceeded():
                    log.warning("reset the link sink: the process outgrew its memory limit")
                    self._sock = self._rebind(self._sock)
                if poll_in(self._sock, 0.1):
                    self._receive()
                self._forget_stale()
        finally:
            self._sock.close(0)

    def _receive(self) -> None:
        try:
            peer, env = recv_message(self._sock, self.limits, routed=True)
            reply = self._handle(peer, env)
        except ProtocolError as exc:
            self.bad_messages += 1
            log.warning("dropped bad bandwidth probe message", peer=exc.sender, reason=exc.reason)
            return
        if reply is not None:
            send_message(self._sock, reply, "sink", route=env.route)

    def _handle(self, peer: str, env: Envelope) -> Message | None:
        """The reply to one probe message, if it completes a step; ProtocolError if bad."""
        msg = env.msg
        if isinstance(msg, LinkHello):
            if env.tensors:
                raise ProtocolError("a hello carries no payload", peer, msg.type)
            key = (peer, msg.probe)
            if key not in self._streams and len(self._streams) >= MAX_PROBES:
                raise ProtocolError(f"already tracking {MAX_PROBES} probes", peer, msg.type)
            self._streams[key] = _Stream(msg.count, msg.nbytes, time.monotonic())
            return LinkReady(probe=msg.probe, count=msg.count, nbytes=msg.nbytes)
        if not isinstance(msg, LinkData):
            raise ProtocolError(f"a sink does not take {msg.type!r} messages", peer, msg.type)
        stream = self._streams.get((peer, msg.probe))
        if stream is None:
            raise ProtocolError(f"data of probe {msg.probe!r} without a hello", peer, msg.type)
        payload = [t.numel() if t.dtype == torch.uint8 else -1 for t in env.tensors]
        if payload != [stream.nbytes]:
            raise ProtocolError(
                f"payload {payload} (bytes of uint8 tensors; -1: another dtype), probe "
                f"announced one of {stream.nbytes}",
                peer,
                msg.type,
            )
        stream.received += 1
        if stream.received < stream.count:
            return None
        del self._streams[(peer, msg.probe)]
        return LinkDone(probe=msg.probe, count=stream.received, nbytes=stream.nbytes * stream.count)

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._streams.items() if now - s.started > self.stale_s]:
            del self._streams[key]


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
    sock: zmq.Socket[Any],
    kind: type[LinkReady | LinkDone],
    probe: str,
    deadline: float,
    addr: str,
    timeout_s: float,
) -> LinkReady | LinkDone:
    """The sink's reply of type `kind` for `probe`, or BandwidthError at `deadline`."""
    while (left := deadline - time.monotonic()) > 0:
        if not poll_in(sock, left):
            break
        try:
            _, env = recv_message(sock, _REPLY_LIMITS)
        except ProtocolError as exc:
            raise BandwidthError(f"bandwidth sink at {addr} sent a bad reply: {exc}") from exc
        got = env.msg
        if isinstance(got, kind) and got.probe == probe:
            return got
    name = kind.model_fields["type"].default
    raise BandwidthError(
        f"no {name!r} reply from a bandwidth sink at {addr} within the probe's "
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
    if not 1 <= nbytes <= MAX_LINK_MESSAGE_BYTES or not 1 <= count <= MAX_COUNT or timeout_s <= 0:
        raise ValueError(
            f"need 1 <= nbytes <= {MAX_LINK_MESSAGE_BYTES}, 1 <= count <= {MAX_COUNT} and "
            f"timeout_s > 0, got {nbytes}, {count} and {timeout_s}"
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
        t0 = time.perf_counter()
        send_message(sock, LinkHello(probe=probe, count=count, nbytes=nbytes), identity)
        _await(sock, LinkReady, probe, deadline, peer_addr, timeout_s)
        rtt = time.perf_counter() - t0
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        for seq in range(count):
            send_message(sock, LinkData(probe=probe, seq=seq), identity, [payload])
        done = _await(sock, LinkDone, probe, deadline, peer_addr, timeout_s)
        elapsed = time.perf_counter() - t0
    except zmq.Again as exc:
        # a sink that refuses the key at the handshake leaves no pipe to send on
        raise BandwidthError(
            f"could not send to {peer_addr} within {timeout_s} s (is a sink running "
            "there, and does it admit this prober's key?)"
        ) from exc
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
