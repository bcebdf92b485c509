"""The worker's control-plane thread: heartbeats out, commands in.

It owns the DEALER to the coordinator and an inproc PULL through which the
main thread sends replies, so heartbeats keep flowing while a round computes.
It answers the coordinator's probes itself, at once: a probe queued behind a
running command would make a busy worker look dead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.codec import Envelope, Limits, encode, recv_message
from common.curve import COORDINATOR, CurveKeys
from common.errors import ProtocolError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Assign, Collect, Heartbeat, Message, Probe, ProbeReply, Shutdown
from common.sockets import connect_dealer

__all__ = ["ControlLink"]

log = get_logger(__name__)
_OUTBOX = "inproc://control-outbox"
_STOP_CHECK_S = 0.5
"""Longest the thread polls before it looks at its stop flag again."""
UNREACHABLE_NOTE_S = 5.0
"""How often a worker that cannot reach its coordinator says so."""
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Socket events that tell whether the coordinator is reached, and if not, why."""
_WHY: dict[int, str] = {
    zmq.EVENT_CONNECT_RETRIED: "nothing accepts connections there (refused or unreachable)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (not a coordinator there?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (not a coordinator there?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the coordinator refused this worker's key (is it in "
    "the coordinator's key set, and the coordinator's public key the set's?)",
}


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
        on_command: Callable[[Message], None] | None = None,
    ) -> None:
        """`on_command` sees each command as it arrives, before the main thread takes it."""
        super().__init__(name="control", daemon=True)
        self.ctx, self.coordinator, self.device = ctx, coordinator, device
        self.limits, self.heartbeat_s, self.heartbeat = limits, heartbeat_s, heartbeat
        self.on_preempt = on_preempt
        self.on_command = on_command
        self.keys = keys
        self.inbox: queue.Queue[Envelope] = queue.Queue()
        self.fence = 0
        """The newest coordinator fence seen: commands stamped with an older one are refused."""
        self.connected = False
        """The handshake with the coordinator succeeded and the connection still stands."""
        self._since = time.monotonic()
        """When the coordinator was last reached (or the link started)."""
        self._next_note = self._since + UNREACHABLE_NOTE_S
        self._why = "no answer yet"
        """The last reason the coordinator was not reached, for the periodic note."""
        self.stop = threading.Event()
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(f"{_OUTBOX}-{id(self)}")
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(f"{_OUTBOX}-{id(self)}")
        self._push_lock = threading.Lock()
        self._closed = False
        """`close` ran: later sends are dropped (the relaying thread is gone)."""

    def send(self, msg: Message) -> None:
        """Send a message to the coordinator (from any thread); never blocks.

        Threads other than the main one send too (a dispatcher reporting a
        neighbour's closed connection while the worker shuts down): a blocking
        send into an outbox nobody reads any more would hold the lock `close`
        needs, and the worker would never exit. So a message that cannot be
        queued at once (the link is closing, or its relay has stalled with a
        full outbox) is dropped and logged, as the relay drops one it cannot
        pass on to the coordinator.
        """
        frames = encode(msg, self.device)
        with self._push_lock:
            if self._closed:
                log.debug("control message dropped: the link is closed", type=msg.type)
                return
            try:
                self._push.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("control message dropped: the link does not relay", type=msg.type)

    def run(self) -> None:
        """Relay until stopped; a bad command is logged and dropped."""
        server_key = self.keys.server_key("coordinator", COORDINATOR) if self.keys else None
        sock = connect_dealer(
            self.ctx,
            self.coordinator,
            self.device,
            keys=self.keys,
            server_key=server_key,
            monitor=_EVENTS,
        )
        monitor = sock.get_monitor_socket()  # attached before the connection: no event missed
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                self._note_unreachable(now)
                if now >= next_beat:
                    # no connection to queue on (its key refused): the next one will do
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(encode(self.heartbeat(), self.device), zmq.NOBLOCK)
                    next_beat = now + self.heartbeat_s
                # a long heartbeat interval must not delay noticing `stop`
                wait_s = min(_STOP_CHECK_S, max(0.0, next_beat - now))
                events = dict(poller.poll(int(wait_s * 1000) or 1))
                if monitor in events and self._connection(
                    int(recv_monitor_message(monitor)["event"])
                ):
                    next_beat = 0.0  # heard within the coordinator's grace, not a tick later
                if self._pull in events:
                    self._relay(sock, self._pull.recv_multipart())
                if sock in events:
                    try:
                        _, env = recv_message(sock, self.limits)
                    except ProtocolError as exc:
                        log.warning(
                            "dropped bad control message", peer="coordinator", reason=exc.reason
                        )
                        continue
                    if env.fence < self.fence:
                        log.warning(
                            "refused a command of an older coordinator",
                            type=env.msg.type,
                            fence=env.fence,
                            current=self.fence,
                        )
                        continue
                    self.fence = env.fence
                    if isinstance(env.msg, Probe):
                        reply = ProbeReply(device=DeviceId(self.device), nonce=env.msg.nonce)
                        sock.send_multipart(encode(reply, self.device))
                        continue
                    if isinstance(env.msg, Assign | Collect | Shutdown):
                        # a round blocked on a dead peer must not delay these
                        self.on_preempt(f"{env.msg.type} received")
                    if self.on_command is not None:
                        self.on_command(env.msg)
                    self.inbox.put(env)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            self._pull.close(0)

    def _relay(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        """Send a reply of the main thread; one that cannot be sent is logged, not fatal."""
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            log.warning(
                "dropped a reply: the coordinator took none for the send timeout",
                coordinator=self.coordinator,
                reason=self._why,
            )

    def _connection(self, event: int) -> bool:
        """Say when the coordinator's connection drops and when it is back; True: it is back.

        A connection back sends a heartbeat at once: a link that dropped for
        less than the coordinator's flap grace is then heard within it, not
        only at the next heartbeat tick.

        ZeroMQ reconnects by itself; heartbeats queue meanwhile, so a restarted
        coordinator hears from this worker as soon as it listens again. Failed
        attempts are only remembered: `_note_unreachable` reports them, a few
        seconds apart, not one line per retry.
        """
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if not self.connected:
                log.info("reached the coordinator", coordinator=self.coordinator)
            self.connected = True
            return True
        if event == zmq.EVENT_DISCONNECTED and self.connected:
            self.connected = False
            self._since = time.monotonic()
            self._next_note = self._since + UNREACHABLE_NOTE_S
            self._why = "the connection dropped"
            log.warning(
                "lost the coordinator; trying to reach it again", coordinator=self.coordinator
            )
        elif event in _WHY:
            self._why = _WHY[event]
        return False

    def _note_unreachable(self, now: float) -> None:
        """Every `UNREACHABLE_NOTE_S` without the coordinator, say so and why.

        A worker given a wrong address, or behind a closed port, would
        otherwise wait in silence.
        """
        if self.connected or now < self._next_note:
            return
        self._next_note = now + UNREACHABLE_NOTE_S
        log.warning(
            "cannot reach the coordinator; still trying",
            coordinator=self.coordinator,
            for_s=round(now - self._since, 1),
            reason=self._why,
        )

    def close(self) -> None:
        """Stop the thread and release the sending socket."""
        self.stop.set()
        self.join(timeout=5)
        with self._push_lock:
            self._closed = True
            self._push.close(0)
