"""The worker's data plane: a receiver thread and a dispatcher thread.

The receiver fills the task pool; the dispatcher sends results, so that
communication overlaps compute.

The receiver hands the pool the peer's routing identity without its nonce
(`common.codec.peer_of_route`; under CURVE the codec has checked its name
against the sender's key), and the pool takes a part only from the device the
plan names for it.

Each thread owns its sockets (ZeroMQ sockets are not thread-safe). A bad frame
is logged with the peer that sent it and dropped; the receiver keeps running.

A dispatcher given a `report` connects to the plan's neighbours as soon as it
learns them (not at the first send, so a neighbour dead before data flows is
noticed too) and watches each connection's monitor socket: a close or a
refusal, and a connection back after one, go to `report` through
`services.worker.peer_watch.LinkWatch`, which bounds what a flapping link sends.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.codec import Envelope, Limits, encode, recv_message
from common.curve import CurveKeys
from common.errors import ConfigError, ProtocolError
from common.inbound import Guard
from common.logging import get_logger
from common.messages import Activation, Gradient, LayerState, Message, ReduceChunk
from common.serving_messages import HmpTile
from common.sockets import bind_router, connect_dealer, reset_router
from services.worker.holdings import Holdings
from services.worker.peer_watch import How, LinkWatch
from services.worker.pool import TaskPool
from services.worker.tiles import TileInbox

__all__ = ["Dispatcher", "LinkReport", "Receiver"]

log = get_logger(__name__)

LinkReport = Callable[[int, str, How], None]
"""Told (epoch, neighbour, "disconnected" | "reconnected") from the dispatcher's thread."""
WATCH_S = 0.02
"""Longest a watching dispatcher goes without reading its monitor sockets."""
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
"""Up (the handshake, not the bare TCP connect: a stopped process's kernel still accepts),
closed, refused."""


class Receiver(threading.Thread):
    """Owns the data-plane ROUTER; decodes every message into the task pool."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind: str,
        limits: Limits,
        pool: TaskPool,
        keys: CurveKeys | None = None,
        holdings: Holdings | None = None,
        tiles: TileInbox | None = None,
    ) -> None:
        super().__init__(name="receiver", daemon=True)
        self.holdings = holdings
        self.tiles = tiles
        # with keys: a CURVE server with this worker's own pair, admitting worker keys only
        self.sock, self.endpoint = bind_router(ctx, bind, limits, keys=keys, roles=("worker",))
        self.ctx = ctx
        self.keys = keys
        self.limits = limits
        self.guard: Guard | None = None
        """Set before `start`: the socket is reset when the process outgrows it."""
        self.pool = pool
        self.stop = threading.Event()
        self.bad_messages = 0

    def run(self) -> None:
        """Receive until stopped; never dies on a bad message."""
        try:
            while not self.stop.is_set():
                if self.guard is not None and self.guard.exceeded():
                    self._reset(self.guard)
                if not self.sock.poll(100, zmq.POLLIN):
                    continue
                try:
                    peer, env = recv_message(self.sock, self.limits, routed=True)
                except ProtocolError as exc:
                    self.bad_messages += 1
                    log.warning(
                        "dropped bad data-plane message", peer=exc.sender, reason=exc.reason
                    )
                    continue
                try:
                    self._deliver(peer, env)
                except Exception as exc:  # a peer's message must never end the receiver
                    self.bad_messages += 1
                    log.exception(
                        "dropped data-plane message", peer=peer, type=env.msg.type, reason=str(exc)
                    )
        finally:
            self.sock.close(0)

    def _reset(self, guard: Guard) -> None:
        """A fresh data socket: peers' unfinished messages grew the process past `guard`."""
        log.warning(
            "reset the data socket: the process outgrew its memory limit (a peer sending "
            "an unfinished message?)",
            limit=guard.limit,
            resets=guard.resets,
        )
        self.sock = reset_router(self.sock, self.ctx, self.limits, self.keys, ("worker",))

    def _deliver(self, peer: str, env: Envelope) -> None:
        msg = env.msg
        why: str | None
        # a device's second connection ("NAME/bulk", for replicas) is the same device;
        # with CURVE the codec has checked NAME against the sender's key
        peer = peer.partition("/")[0]
        if isinstance(msg, Activation | Gradient):
            want = 2 if isinstance(msg, Activation) else 1
            if len(env.tensors) != want or env.tensors[0].shape[:1] != (msg.hi - msg.lo,):
                why = f"{msg.type} for [{msg.lo}, {msg.hi}) with tensors " + str(
                    [tuple(t.shape) for t in env.tensors]
                )
            else:
                why = self.pool.put_part(msg, env.tensors, peer)
        elif isinstance(msg, ReduceChunk) and len(env.tensors) == 1:
            why = self.pool.put_chunk(msg, env.tensors[0], peer)
        elif isinstance(msg, LayerState) and self.holdings is not None and _one_blob(env):
            why = self.holdings.put(msg, env.tensors[0].numpy().tobytes(), peer)
        elif isinstance(msg, HmpTile) and self.tiles is not None and len(env.tensors) == 1:
            why = self.tiles.put(msg, env.tensors[0], peer)
        else:
            why = f"unexpected {msg.type} with {len(env.tensors)} tensors on the data plane"
        if why:
            log.warning(
                "dropped data-plane message",
                peer=peer,
                type=msg.type,
                msg_round=getattr(msg, "round", None),  # `round` is the worker's own
                reason=why,
            )


def _one_blob(env: Envelope) -> bool:
    """Whether a message carries exactly one 1-D uint8 tensor (a layer's blob)."""
    return (
        len(env.tensors) == 1 and env.tensors[0].dtype == torch.uint8 and env.tensors[0].dim() == 1
    )


class Dispatcher(threading.Thread):
    """Sends queued messages to peers asynchronously, one DEALER per peer."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        device: str,
        keys: CurveKeys | None = None,
        session: str = "",
        report: LinkReport | None = None,
    ) -> None:
        """With `report`, neighbours' connections are watched (see the module's doc)."""
        super().__init__(name=f"dispatcher{'-' + session if session else ''}", daemon=True)
        self.ctx = ctx
        self.device = device
        self.identity = f"{device}/{session}" if session else device
        """Routing identity: a second dispatcher of one device ("NAME/bulk") gets its own
        connection to each peer, so what it sends never queues ahead of the first's."""
        self.keys = keys
        self.peers: dict[str, str] = {}
        self.q: queue.Queue[tuple[str, list[Any]] | None] = queue.Queue()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[str, zmq.Socket[Any]] = {}
        """The monitor socket of each peer's DEALER (with `report` only)."""
        self.report = report
        self.links = LinkWatch()
        self.error: Exception | None = None

    def set_peers(self, peers: dict[str, str], epoch: int = -1, watch: Iterable[str] = ()) -> None:
        """Data-plane addresses of the plan's devices; connects to `watch` (plan `epoch`) now.

        Other peers are connected at their first message.
        """
        self.q.put(("__peers__", [dict(peers), epoch, frozenset(watch)]))

    def send(self, dst: str, msg: Message, tensors: list[torch.Tensor] | tuple[()] = ()) -> None:
        """Queue a message; tensors must stay unchanged until sent (zero-copy)."""
        self.q.put((dst, encode(msg, self.device, tensors)))

    def close(self) -> None:
        """Stop after sending what is queued."""
        self.q.put(None)

    def run(self) -> None:
        """Send queued frames until closed; a failed send is kept for the round to report."""
        next_watch = 0.0
        try:
            while True:
                try:
                    item = self.q.get(timeout=WATCH_S) if self.report else self.q.get()
                except queue.Empty:
                    item = ("", [])
                if item is None:
                    break
                if self.report is not None and time.monotonic() >= next_watch:
                    self._watch()
                    next_watch = time.monotonic() + WATCH_S
                dst, frames = item
                if dst == "__peers__":
                    self._repoint(frames[0], frames[1], frames[2])
                elif dst:
                    self._send(dst, frames)
        finally:
            for name in list(self._socks):
                self._close(name)

    def _send(self, dst: str, frames: list[Any]) -> None:
        try:
            self._sock(dst).send_multipart(frames, copy=False)
        except (zmq.ZMQError, KeyError, ConfigError) as exc:
            self.error = exc
            log.error("send failed", peer=dst, error=str(exc))

    def _repoint(self, peers: dict[str, str], epoch: int, watch: frozenset[str]) -> None:
        for name in list(self._socks):
            if peers.get(name) != self.peers.get(name):
                self._close(name)
                self.links.forget(name)
        self.peers = peers
        if self.report is None:
            return
        self.links.repoint(epoch, (p for p in watch if p in peers))
        for peer in sorted(self.links.watched):
            try:
                self._sock(peer)
            except (zmq.ZMQError, ConfigError) as exc:  # its send will say so too
                log.warning("cannot connect to a neighbour", peer=peer, error=str(exc))
        self._watch()

    def _watch(self) -> None:
        """Read every monitor event waiting; tell `report` what changed."""
        for peer, mon in self._monitors.items():
            while mon.poll(0, zmq.POLLIN):
                event = int(recv_monitor_message(mon)["event"])
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.links.connected(peer)
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                    self.links.closed(peer)
        assert self.report is not None
        for peer, how in self.links.due(time.monotonic()):
            log.info("neighbour connection", peer=peer, how=how, epoch=self.links.epoch)
            try:
                self.report(self.links.epoch, peer, how)
            except Exception:  # lost evidence is the heartbeats' to cover, not a send's
                log.exception("could not report a neighbour's connection", peer=peer)

    def _close(self, peer: str) -> None:
        """Close the DEALER to `peer` and its monitor socket, if it has one."""
        sock = self._socks.pop(peer)
        mon = self._monitors.pop(peer, None)
        if mon is not None:
            sock.disable_monitor()
            mon.close(0)
        sock.close(0)

    def _sock(self, dst: str) -> zmq.Socket[Any]:
        sock = self._socks.get(dst)
        if sock is None:
            # with keys: a CURVE client of the peer's own pair (its public file in the set)
            server_key = self.keys.server_key("worker", dst) if self.keys else None
            sock = connect_dealer(
                self.ctx,
                self.peers[dst],
                self.identity,
                keys=self.keys,
                server_key=server_key,
                monitor=_LINK_EVENTS if self.report is not None else 0,
            )
            if self.report is not None:
                self._monitors[dst] = sock.get_monitor_socket()
            self._socks[dst] = sock
        return sock
