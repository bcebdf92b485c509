"""Whether the coordinator answers, whether the CURVE keys match, and the clock offset to it.

One DEALER, as a worker's, with a monitor on its socket events: ZeroMQ tells
"nothing listens" (the connection is refused), "something listens but speaks
no ZeroMQ" (connected, no handshake), "the coordinator refused this key"
(ZAP's 400), "the coordinator's public key is not this coordinator's" (the
server could not open the client's HELLO) and "one side uses CURVE, the other
not" (a mechanism mismatch) apart. After a handshake, a few LocateRedis
requests measure the round trip and read the coordinator's clock from its
replies' header time; the same answer says where Redis is.

The reading of events (`reach_of`) and the wording (`coordinator_checks`) are
pure; only `visit` touches the network, and every wait in it ends by `timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import zmq

from common.curve import COORDINATOR, FOLDERS, CurveKeys
from services.cli.doctor.report import Check

if TYPE_CHECKING:
    from common.messages import RedisLocation

__all__ = ["SAMPLES", "Reach", "Visit", "coordinator_checks", "reach_of", "visit"]

Reach = Literal[
    "answered",
    "busy",
    "key_refused",
    "wrong_server_key",
    "mechanism",
    "not_zmq",
    "nothing",
    "silent",
]
"""How far a visit got: answered (handshake and a reply), busy (handshake, no reply in time),
key_refused, wrong_server_key, mechanism (CURVE on one side only), not_zmq (a connection, no
ZeroMQ handshake), nothing (connection refused), silent (no connection in time)."""

SAMPLES = 3
"""LocateRedis round trips made; the shortest gives the clock offset (least queueing in it)."""

_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DECISIVE = (
    zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Events after which waiting longer tells nothing more."""


@dataclass(frozen=True)
class Visit:
    """What one visit to the coordinator learnt.

    Attributes:
        address: The coordinator's control address.
        reach: How far it got (see `Reach`).
        location: Where the coordinator says Redis is (None without an answer).
        offset_s: The coordinator's clock minus this host's, from the best sample.
        rtt_s: That sample's round trip: the offset is known to within half of it.

    """

    address: str
    reach: Reach
    location: RedisLocation | None = None
    offset_s: float | None = None
    rtt_s: float | None = None


def reach_of(events: Sequence[int], answered: bool) -> Reach:
    """How far a connection got, from its socket's monitor events (in order) and any reply."""
    seen = set(events)
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
        return "answered" if answered else "busy"
    if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen:
        return "key_refused"
    if zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in seen:
        return "mechanism"
    if zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL in seen:
        return "wrong_server_key"
    if zmq.EVENT_CONNECTED in seen:
        return "not_zmq"
    if zmq.EVENT_CONNECT_RETRIED in seen:
        return "nothing"
    return "silent"


def _monitor_events(monitor: zmq.Socket[Any], deadline: float) -> list[int]:
    """Events until a decisive one or `deadline`."""
    from zmq.utils.monitor import recv_monitor_message

    events: list[int] = []
    while (left := deadline - time.monotonic()) > 0:
        if not monitor.poll(max(1, int(left * 1000)), zmq.POLLIN):
            break
        event = int(recv_monitor_message(monitor)["event"])
        events.append(event)
        if event & _DECISIVE:
            break
    return events


def visit(address: str, keys: CurveKeys | None, timeout_s: float) -> Visit:
    """Connect to the coordinator at `address` as `keys` (plain without) and ask where Redis is.

    The handshake gets `timeout_s`, and the requests another `timeout_s` in all.
    """
    from common.codec import Limits, encode, recv_message
    from common.errors import ProtocolError
    from common.messages import LocateRedis, RedisLocation
    from common.sockets import connect_dealer

    ctx: zmq.Context[Any] = zmq.Context()
    identity = f"{keys.name}/doctor" if keys else "doctor"
    server_key = keys.server_key("coordinator", COORDINATOR) if keys else None
    sock = connect_dealer(ctx, address, identity, keys=keys, server_key=server_key, monitor=_EVENTS)
    monitor = sock.get_monitor_socket()
    try:
        events = _monitor_events(monitor, time.monotonic() + timeout_s)
        if zmq.EVENT_HANDSHAKE_SUCCEEDED not in events:
            return Visit(address, reach_of(events, answered=False))
        limits = Limits(max_tensor_bytes=0, max_tensors=0)
        best: tuple[float, float, RedisLocation] | None = None  # (rtt, offset, answer)
        deadline = time.monotonic() + timeout_s
        for nonce in range(1, SAMPLES + 1):
            sent = time.time()
            sock.send_multipart(encode(LocateRedis(nonce=nonce), identity), zmq.NOBLOCK)
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    break
                try:
                    _, env = recv_message(sock, limits)
                except ProtocolError:
                    continue
                got = time.time()
                if isinstance(env.msg, RedisLocation) and env.msg.nonce == nonce:
                    rtt, offset = got - sent, env.sent_at - (sent + got) / 2
                    if best is None or rtt < best[0]:
                        best = (rtt, offset, env.msg)
                    break
        if best is None:
            return Visit(address, "busy")
        return Visit(address, "answered", best[2], best[1], best[0])
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def _port(address: str) -> str:
    return address.rsplit(":", 1)[-1]


def _host(address: str) -> str:
    return address.partition("://")[2].rsplit(":", 1)[0]


def _key_file(keys: CurveKeys) -> Path:
    return keys.root / FOLDERS[keys.role] / f"{keys.name}.key"


def coordinator_checks(v: Visit, keys: CurveKeys | None, timeout_s: float) -> list[Check]:
    """The `coordinator` and `keys` rows of a visit, each problem with its fix."""
    where = v.address
    reach = v.reach
    if reach == "wrong_server_key" and keys is None:  # no server key to blame: not a coordinator
        reach = "not_zmq"
    as_whom = f"as {keys.role}:{keys.name}" if keys else "without keys (plain, loopback only)"
    start = (
        f"start it there: asteroid-coordinator --bind tcp://0.0.0.0:{_port(where)} --keys DIR "
        "(or pass the right --coordinator)"
    )
    data: dict[str, Any] = {"address": where, "reach": reach}
    keys_unknown = Check("keys", "skipped", "not known: no handshake with a coordinator")
    if reach == "answered":
        keys_ok = Check(
            "keys",
            "ok",
            f"the coordinator accepted this device {as_whom}"
            if keys
            else "plain: neither side uses CURVE keys",
            data={"role": keys.role if keys else None, "name": keys.name if keys else None},
        )
        return [Check("coordinator", "ok", f"answers at {where}", data=data), keys_ok]
    if reach == "busy":
        return [
            Check(
                "coordinator",
                "problem",
                f"took the connection at {where} but did not answer within {timeout_s:g} s: it is "
                "busy or stuck",
                f"asteroid doctor --timeout {max(10.0, 4 * timeout_s):g}, or look at its log",
                data,
            ),
            Check("keys", "ok", f"the handshake {as_whom} succeeded"),
        ]
    if reach in ("key_refused", "wrong_server_key", "mechanism"):
        up = Check("coordinator", "ok", f"listens at {where}", data=data)
        return [up, _keys_problem(reach, keys, _host(where))]
    if reach == "nothing":
        return [
            Check(
                "coordinator",
                "problem",
                f"nothing accepts connections at {where} (connection refused)",
                start,
                data,
            ),
            keys_unknown,
        ]
    if reach == "not_zmq":
        return [
            Check(
                "coordinator",
                "problem",
                f"something at {where} took the connection but made no ZeroMQ handshake within "
                f"{timeout_s:g} s: not a coordinator",
                f"check the port: the coordinator's --bind; {start}",
                data,
            ),
            keys_unknown,
        ]
    host = _host(where)
    return [
        Check(
            "coordinator",
            "problem",
            f"no connection to {where} within {timeout_s:g} s: the host is down or unreachable, "
            "or a firewall drops the port",
            f"ping {host}; on the coordinator: sudo ufw allow {_port(where)}/tcp",
            data,
        ),
        keys_unknown,
    ]


def _keys_problem(reach: Reach, keys: CurveKeys | None, host: str) -> Check:
    """The `keys` row when the handshake itself failed: which key is wrong and how to mend it."""
    if reach == "mechanism":
        if keys is None:
            return Check(
                "keys",
                "problem",
                "the coordinator uses CURVE keys and this device has none",
                "copy the cluster's key set here (made by `asteroid keys init`) and pass --keys "
                "DIR (or set ASTEROID_KEYS)",
            )
        return Check(
            "keys",
            "problem",
            "this device uses CURVE keys but the coordinator runs without",
            "restart the coordinator with --keys DIR (the set this device's came from), or "
            "drop --keys here on a loopback-only cluster",
        )
    if keys is None:  # a plain client meets neither a key check nor a server key
        return Check(
            "keys",
            "problem",
            "the handshake with the coordinator failed",
            "pass --keys DIR, the cluster's key set (made by `asteroid keys init`)",
        )
    mine = _key_file(keys)
    if reach == "key_refused":
        return Check(
            "keys",
            "problem",
            f"the coordinator refused this device's key ({keys.role}:{keys.name}): its public "
            f"key, {FOLDERS[keys.role]}/{mine.name}, is not in the coordinator's key set",
            f"scp {mine} {host}:KEYS/{FOLDERS[keys.role]}/ (KEYS: the coordinator's --keys; it "
            "reads the key files at each connection, so no restart)",
            data={"role": keys.role, "name": keys.name},
        )
    theirs = keys.root / FOLDERS["coordinator"] / f"{COORDINATOR}.key"
    return Check(
        "keys",
        "problem",
        f"the coordinator's public key in {theirs} is not this coordinator's (it could not "
        "read this device's handshake): the key set is another cluster's",
        f"scp {host}:KEYS/coordinator/coordinator.key {theirs} (KEYS: the coordinator's --keys)",
        data={"role": keys.role, "name": keys.name},
    )
