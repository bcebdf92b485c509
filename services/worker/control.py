"""The worker's control-plane thread: heartbeats out, commands in.

It owns the DEALER to the coordinator and an inproc PULL through which the
main thread sends replies, so heartbeats keep flowing while a round computes.
It answers the coordinator's probes itself, at once: a probe queued behind a
running command would make a busy worker look dead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from common.codec import Envelope, Limits, encode, recv_message
from common.curve import COORDINATOR, CurveKeys
from common.errors import ProtocolError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Assign, Heartbeat, Message, Probe, ProbeReply, Shutdown
from common.sockets import connect_dealer

__all__ = ["ControlLink"]

log = get_logger(__name__)
_OUTBOX = "inproc://control-outbox"
_STOP_CHECK_S = 0.5
"""Longest the thread polls before it looks at its stop flag again."""


class ControlLink(threading.Thread):
    """Connects to the coordinator; `inbox` receives its commands, `send` replies."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        coordinator: str,
        device: str,
        limits: Limits,
        heartbeat_s: float,
        heartbeat: Callable[[], Heartbeat],
        on_preempt: Callable[[str], None],
        keys: CurveKeys | None = None,
    ) -> None:
        super().__init__(name="control", daemon=True)
        self.ctx, self.coordinator, self.device = ctx, coordinator, device
        self.limits, self.heartbeat_s, self.heartbeat = limits, heartbeat_s, heartbeat
        self.on_preempt = on_preempt
        self.keys = keys
        self.inbox: queue.Queue[Envelope] = queue.Queue()
        self.stop = threading.Event()
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(f"{_OUTBOX}-{id(self)}")
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(f"{_OUTBOX}-{id(self)}")
        self._push_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        """Send a message to the coordinator (from any thread)."""
        frames = encode(msg, self.device)
        with self._push_lock:
            self._push.send_multipart(frames)

    def run(self) -> None:
        """Relay until stopped; a bad command is logged and dropped."""
        server_key = self.keys.server_key("coordinator", COORDINATOR) if self.keys else None
        sock = connect_dealer(
            self.ctx, self.coordinator, self.device, keys=self.keys, server_key=server_key
        )
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    sock.send_multipart(encode(self.heartbeat(), self.device))
                    next_beat = now + self.heartbeat_s
                # a long heartbeat interval must not delay noticing `stop`
                wait_s = min(_STOP_CHECK_S, max(0.0, next_beat - now))
                events = dict(poller.poll(int(wait_s * 1000) or 1))
                if self._pull in events:
                    sock.send_multipart(self._pull.recv_multipart())
                if sock in events:
                    try:
                        _, env = recv_message(sock, self.limits)
                    except ProtocolError as exc:
                        log.warning(
                            "dropped bad control message", peer="coordinator", reason=exc.reason
                        )
                        continue
                    if isinstance(env.msg, Probe):
                        reply = ProbeReply(device=DeviceId(self.device), nonce=env.msg.nonce)
                        sock.send_multipart(encode(reply, self.device))
                        continue
                    if isinstance(env.msg, Assign | Shutdown):
                        # a round blocked on a dead peer must not delay these
                        self.on_preempt(f"{env.msg.type} received")
                    self.inbox.put(env)
        finally:
            sock.close(0)
            self._pull.close(0)

    def close(self) -> None:
        """Stop the thread and release the sending socket."""
        self.stop.set()
        self.join(timeout=5)
        with self._push_lock:
            self._push.close(0)
