"""The coordinator's control socket: who may send what, and the way back to each peer.

One ROUTER carries the control plane; its monitor tells which peers' connections
closed (`closed`), the fastest sign that a worker process died (its kernel
closes its sockets at once). Reading it is bounded (`receive` hands on
at most `PUMP_MAX_MESSAGES` messages or `PUMP_MAX_S` seconds' worth per call),
every message is checked against its sender before anyone sees it (a device
claims only its own name; each key role sends only its own message types), and
a bad message is counted, logged with its sender and dropped, never raised.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.codec import Limits, recv_message, send_message
from common.curve import is_loopback, load_keys
from common.errors import ConfigError, ProtocolError
from common.ids import DeviceId
from common.inbound import MemoryGuard
from common.logging import get_logger
from common.messages import JobReply, Message
from common.settings import CoordinatorSettings
from common.sockets import bind_router, reset_router

__all__ = [
    "ANY_ROLE",
    "CLIENT_REQUESTS",
    "CLOSED_MAX",
    "CONTROL_ROLES",
    "HELD_PER_PEER",
    "HELD_S",
    "MAX_ROUTES",
    "NAME",
    "PUMP_MAX_MESSAGES",
    "PUMP_MAX_S",
    "SENDER_ROLES",
    "ControlSocket",
    "role_refusal",
]

log = get_logger(__name__)
NAME = "coordinator"
CLIENT_REQUESTS = ("submit_job", "cancel_job", "drain_device", "serve_model", "infer_request")
"""Requests whose sender is told why a malformed one was refused."""
PUMP_MAX_MESSAGES = 500
"""Most messages one `receive` call hands on before its caller looks at its deadlines again."""
PUMP_MAX_S = 0.05
"""Longest one `receive` call spends reading messages, for the same reason."""
MAX_ROUTES = 4_096
"""Peers whose latest connection is remembered: far beyond a cluster's devices, services
and clients; a device heartbeats every second, so it is never the least recent."""
CLOSED_MAX = 4_096
"""Closed connections kept until the loop reads them (the oldest go beyond)."""
HELD_PER_PEER = 64
"""Messages kept for a device whose connection is down; the oldest go beyond."""
HELD_S = 3.0
"""How long a device's connection may stay down for what was kept for it to be delivered
(the loop sets `hold_s` to the flap grace in force: a device down longer has been declared
lost, and an old epoch's commands would only confuse it)."""
HELD_PEERS = 1_024
"""Devices messages are kept for at most; the least recent go beyond."""
MONITOR_MAX_EVENTS = 1_000
"""Most monitor events one `receive` call reads (the rest wait for the next call)."""
CONTROL_ROLES = ("worker", "service", "operator")
"""Key roles the control socket admits; what each may send is `SENDER_ROLES`."""
SENDER_ROLES = {
    "heartbeat": "worker",
    "assigned": "worker",
    "round_done": "worker",
    "eval_done": "worker",
    "checkpoint_saved": "worker",
    "worker_error": "worker",
    "probe_reply": "worker",
    "peer_down": "worker",
    "replica_saved": "worker",
    "links_measured": "worker",
    "blocks_profiled": "worker",
    "shard_loaded": "worker",
    "inference_done": "worker",
    "inference_progress": "worker",
    "service_hello": "service",
    "plan_reply": "service",
    "profile_reply": "service",
    "submit_job": "operator",
    "cancel_job": "operator",
    "drain_device": "operator",
    "serve_model": "operator",
    "infer_request": "operator",
}
"""The key role that may send each message type to the coordinator (with CURVE)."""
ANY_ROLE = ("locate_redis",)
"""Requests any key of the set may send: their answers hold nothing secret."""


def role_refusal(user: str, kind: str) -> str | None:
    """Why a message of type `kind` from authenticated key `user` is refused, or None.

    `user` is "ROLE:NAME" from the CURVE handshake ("" without keys, where the
    socket is on loopback and every local process is trusted alike).
    """
    if not user or kind in ANY_ROLE:
        return None
    role = user.partition(":")[0]
    wanted = SENDER_ROLES.get(kind)
    if wanted == role:
        return None
    expected = f"a key of role {wanted}" if wanted else "no key (nobody may send it)"
    return f"{kind} from {role} key {user!r}: expected {expected}"


class ControlSocket:
    """The bound ROUTER, its routes back to peers, and the checks on what arrives."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        """Bind the control socket; refuse a non-loopback address without CURVE keys.

        Raises:
            ConfigError: `settings.bind` is reachable from a network and no keys are set.

        """
        # the control plane carries no tensors: a frame beyond one header is refused by
        # ZeroMQ itself, so the queue of unread messages is bounded in bytes too
        self.limits = Limits(settings.max_header_bytes, max_tensor_bytes=0, max_tensors=0)
        keys = load_keys(settings.keys, "coordinator")
        if keys is None and not is_loopback(settings.bind):
            raise ConfigError(
                f"refusing to bind {settings.bind} without CURVE keys: anyone on that network "
                "could join as a worker or submit jobs. Make a key set with `asteroid keys "
                "init DIR --worker NAME ... --operator NAME` and pass --keys DIR (or "
                "ASTEROID_KEYS), or bind to 127.0.0.1"
            )
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock, self.endpoint = bind_router(
            self.ctx, settings.bind, self.limits, keys=keys, roles=CONTROL_ROLES
        )
        self._keys = keys
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed connection says so
        self.held: OrderedDict[str, deque[tuple[float, Message]]] = OrderedDict()
        """Messages for devices whose connection was down, delivered when they speak again."""
        self.hold_s = HELD_S
        """How long a connection may stay down for what was kept to be delivered."""
        self._down: OrderedDict[str, float] = OrderedDict()
        """When each device's connection was seen to close (until it speaks again)."""
        self._monitor = self._watch()
        self._fds: dict[int, DeviceId] = {}
        """The peer each open connection's descriptor last carried a message of."""
        self._fresh: set[int] = set()
        """Descriptors that carried a message since the monitor was last read."""
        self.closed: deque[tuple[DeviceId, float]] = deque(maxlen=CLOSED_MAX)
        """Peers whose connection closed, and when (monotonic), for the loop to read."""
        self.guard = MemoryGuard.above_now(settings.inbound_margin)
        """Resets the socket should peers' unfinished messages outgrow the margin."""
        self.routes: OrderedDict[str, bytes] = OrderedDict()
        """Each peer's latest connection (`common.codec.peer_of_route`), which sends go to."""
        self.fence = 0
        """The fencing epoch every message sent is stamped with (0 until raised)."""
        self.bad_messages = 0

    def send(self, peer: DeviceId, msg: Message) -> None:
        """Send a control message to a peer, stamped with the fence.

        It goes to the connection `peer` last spoke on; one it never spoke on
        gets nothing (as ZeroMQ drops a message to an unknown route). Should
        that connection be closed (a link that flaps), a device's message is
        kept (`held`) and delivered once the device speaks again on a new one,
        so a command sent during a short cut is late, not lost.
        """
        route = self.routes.get(peer)
        if route is None:
            return
        try:
            send_message(self.sock, msg, NAME, route=route, fence=self.fence)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if "/" not in peer:  # a client's session does not come back: drop it
                held = self.held.setdefault(peer, deque(maxlen=HELD_PER_PEER))
                held.append((time.monotonic(), msg))
                self.held.move_to_end(peer)
                while len(self.held) > HELD_PEERS:
                    self.held.popitem(last=False)

    def _deliver_held(self, peer: str) -> None:
        """Send `peer` what was kept while its connection was down, in order.

        Nothing if the connection was down longer than `hold_s`: the device
        was declared lost meanwhile, and its commands are an old epoch's.
        """
        now = time.monotonic()
        down = now - self._down.pop(peer, now)
        held = self.held.pop(peer, ())
        fresh = [msg for at, msg in held if down <= self.hold_s and now - at <= self.hold_s]
        if len(fresh) < len(held):
            log.info(
                "dropped messages held while its connection was down",
                peer=peer,
                n=len(held) - len(fresh),
                down_s=round(down, 3),
            )
        if fresh:
            log.info(
                "delivering messages held while its connection was down",
                peer=peer,
                types=[m.type for m in fresh],
            )
        for msg in fresh:
            self.send(DeviceId(peer), msg)

    def remember_route(self, peer: str, route: bytes) -> None:
        """`peer`'s latest connection, newest last; the least recent beyond `MAX_ROUTES` go."""
        self.routes[peer] = route
        self.routes.move_to_end(peer)
        while len(self.routes) > MAX_ROUTES:
            self.routes.popitem(last=False)

    def receive(self, timeout_s: float) -> Iterator[tuple[DeviceId, Message]]:
        """Wait up to `timeout_s` for a message, then yield those waiting, within bounds.

        Returns as soon as the socket is drained, so a caller waiting for a
        reply sees it without sitting out the rest of its poll interval; and
        after `PUMP_MAX_MESSAGES` messages or `PUMP_MAX_S` seconds at most, so a
        flood cannot keep a caller from its deadlines (the rest waits in the
        socket for the next call). Yields only messages that passed the sender checks.
        """
        self._reset_if_outgrown()
        wait_ms = int(timeout_s * 1000)
        handled = 0
        stop = math.inf
        while handled < PUMP_MAX_MESSAGES and time.monotonic() < stop:
            if not self.sock.poll(wait_ms, zmq.POLLIN):
                break
            if handled == 0:
                stop = time.monotonic() + PUMP_MAX_S
            wait_ms = 0
            handled += 1
            try:
                peer, env = recv_message(self.sock, self.limits, routed=True)
            except ProtocolError as exc:
                self.bad_messages += 1
                log.warning("dropped bad control message", peer=exc.sender, reason=exc.reason)
                self._refuse_request(exc)
                continue
            self.remember_route(peer, env.route)
            if peer in self.held or peer in self._down:
                self._deliver_held(peer)
            if env.fd >= 0 and "/" not in peer:  # sessions (NAME/SESSION) are never devices
                self._fds[env.fd] = DeviceId(peer)
                self._fresh.add(env.fd)
            if self._admitted(peer, env.user, env.msg):
                yield DeviceId(peer), env.msg
        self._read_monitor()

    def _watch(self) -> zmq.Socket[Any]:
        """The monitor of the ROUTER: connections accepted and closed, each by descriptor.

        ZeroMQ names a closed connection by its descriptor, not its routing id;
        every message's frame names the descriptor it came on (`Envelope.fd`,
        ZMQ_SRCFD), so the last peer heard on a descriptor is the one that closed.
        """
        return self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def _read_monitor(self) -> None:
        """Note the peers whose connection closed since the last call, with the time now.

        Read after the messages waiting, so a message its peer sent before its
        connection closed is not taken for a sign of life after the close. A
        descriptor accepted again belongs to a new connection whose peer is not
        known until it speaks (unless it spoke in this very call: its accept is
        read after its first message). Should a descriptor close and be reused
        within one call, the closed one may be taken for the new one's peer: a
        false suspect, which its heartbeats or its probe's answer clear.
        """
        now = time.monotonic()
        fresh, self._fresh = self._fresh, set()
        for _ in range(MONITOR_MAX_EVENTS):
            if not self._monitor.poll(0, zmq.POLLIN):
                return
            try:
                event = parse_monitor_message(self._monitor.recv_multipart())
            except (zmq.ZMQError, ValueError, TypeError) as exc:
                log.warning("unreadable control socket event", error=str(exc))
                continue
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                if fd not in fresh:
                    self._fds.pop(fd, None)
            elif (peer := self._fds.pop(fd, None)) is not None:
                self.closed.append((peer, now))
                self._down[peer] = now
                self._down.move_to_end(peer)
                while len(self._down) > HELD_PEERS:
                    self._down.popitem(last=False)

    def _admitted(self, peer: str, user: str, msg: Message) -> bool:
        """Whether `peer` may send `msg`: it names no other device, its key's role allows it."""
        claimed = getattr(msg, "device", None)
        if claimed is not None and (claimed != peer or "/" in claimed):
            # NAME/SESSION is one of key NAME's connections, never a device of its own
            self.bad_messages += 1
            log.warning(
                "dropped message whose device differs from its sender",
                peer=peer,
                claimed=claimed,
                type=msg.type,
            )
            return False
        why = role_refusal(user, msg.type)
        if why is None:
            return True
        self.bad_messages += 1
        log.warning("dropped message outside its key's role", peer=peer, reason=why)
        if msg.type in CLIENT_REQUESTS:  # say so
            self.send(DeviceId(peer), JobReply(job_id="", ok=False, error=why))
        return False

    def _refuse_request(self, exc: ProtocolError) -> None:
        """Answer an undecodable client request so that its sender learns why.

        A job spec that breaks a bound (a job_id outside the pattern, num_classes
        beyond the limit) fails validation while the message is decoded; the
        reason names the field. Other bad messages are only dropped.
        """
        if not exc.route or exc.kind not in CLIENT_REQUESTS:
            return
        self.remember_route(exc.sender, exc.route)
        self.send(DeviceId(exc.sender), JobReply(job_id="", ok=False, error=exc.reason))

    def _reset_if_outgrown(self) -> None:
        """Replace the socket (dropping peers' unfinished messages) past the memory margin."""
        if self.guard.exceeded():
            log.warning(
                "reset the control socket: the coordinator outgrew its memory limit (a peer "
                "sending an unfinished message?)",
                limit=self.guard.limit,
                resets=self.guard.resets,
            )
            self._monitor.close(0)
            self.sock = reset_router(self.sock, self.ctx, self.limits, self._keys, CONTROL_ROLES)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._monitor, self._fds = self._watch(), {}

    def close(self) -> None:
        """Release the socket, its monitor and its context."""
        self._monitor.close(0)
        self.sock.close(0)
        self.ctx.term()
