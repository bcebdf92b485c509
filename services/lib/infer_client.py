"""A requester's side of serving: send one InferRequest, read its chunks, then its reply.

What `asteroid infer` and the HTTP gateway share. A DEALER with a fresh
identity per request (never REQ: a dead coordinator must not wedge the
socket), over CURVE as an operator when keys are given. A streamed request
(`InferRequest.stream`) is answered with `InferChunk`s, in order, then the
`InferReply`, which holds every token again; any other request with the reply
alone. Every wait has a deadline, and the error says whether the coordinator
was not there at all or only busy.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from contextlib import closing
from typing import Any

import zmq

from common.codec import Limits, recv_message, send_message
from common.curve import COORDINATOR, CurveKeys
from common.errors import AsteroidError, ProtocolError, Unreachable
from common.logging import get_logger
from common.messages import JobReply
from common.serving_messages import InferChunk, InferReply, InferRequest
from common.sockets import connect_dealer

__all__ = ["InferRefused", "InferUnanswered", "infer", "operator_dealer", "stream_infer"]

log = get_logger(__name__)


def operator_dealer(
    ctx: zmq.Context[Any], address: str, keys: CurveKeys | None, label: str
) -> zmq.Socket[Any]:
    """A DEALER to the coordinator at `address` with a fresh identity, watching its handshake.

    With `keys` (an operator's key set) over CURVE as that operator, identity
    NAME/SESSION; without, LABEL-SESSION on a loopback coordinator. The handshake
    monitor (`get_monitor_socket`) tells a busy coordinator from an absent one.
    """
    session = uuid.uuid4().hex[:12]
    return connect_dealer(
        ctx,
        address,
        f"{keys.name}/{session}" if keys else f"{label}-{session}",
        keys=keys,
        server_key=keys.server_key("coordinator", COORDINATOR) if keys else None,
        monitor=zmq.EVENT_HANDSHAKE_SUCCEEDED,
    )


class InferUnanswered(Unreachable):
    """No reply from the coordinator before the deadline."""


class InferRefused(AsteroidError):
    """The coordinator refused the request before running it (its key's role, a bad field)."""


def stream_infer(
    address: str,
    request: InferRequest,
    keys: CurveKeys | None = None,
    *,
    timeout_s: float = 120.0,
) -> Generator[InferChunk | InferReply, None, None]:
    """Send `request` to the coordinator at `address`; yield its chunks, then its reply.

    `keys`: this operator's key set (CURVE; the identity is its name plus a
    session), or None on a loopback coordinator. A refusal before the request
    runs (no such serving job, a full queue) is an `InferReply` with `ok`
    False, as the coordinator sends it. Closing the iterator early closes the
    socket; the request still runs to its end on the devices.

    Raises:
        InferUnanswered: If the reply has not come within `timeout_s` of sending.
        InferRefused: If the coordinator refused the message itself.

    """
    ctx: zmq.Context[Any] = zmq.Context()
    sock = operator_dealer(ctx, address, keys, "infer")
    monitor = sock.get_monitor_socket()
    try:
        send_message(sock, request, "infer")
        if (yield from _answers(sock, request, timeout_s)):
            return
        if monitor.poll(0, zmq.POLLIN):  # the handshake succeeded: it is there, only busy
            raise InferUnanswered(
                f"the coordinator at {address} took the request for {request.serve_id} but did "
                f"not answer within {timeout_s:.0f} s: it is busy (requests wait their turn); "
                "wait longer or try again later"
            )
        raise InferUnanswered(
            f"no coordinator answered at {address} within {timeout_s:.0f} s "
            "(is asteroid-coordinator running there, and are the keys its own?)"
        )
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def _answers(
    sock: zmq.Socket[Any], request: InferRequest, timeout_s: float
) -> Generator[InferChunk | InferReply, None, bool]:
    """The request's chunks and reply as they arrive; True at the reply, False at the deadline."""
    limits = Limits()
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
        try:
            _, env = recv_message(sock, limits)
        except ProtocolError as exc:
            log.warning("dropped an unreadable message from the coordinator", error=str(exc))
            continue
        msg = env.msg
        if isinstance(msg, InferReply) and msg.serve_id == request.serve_id:
            yield msg
            return True
        if isinstance(msg, InferChunk) and msg.serve_id == request.serve_id:
            yield msg
        elif isinstance(msg, JobReply) and not msg.ok:
            raise InferRefused(f"the coordinator refused the infer_request: {msg.error}")
        else:
            log.warning("dropped an unexpected message from the coordinator", type=msg.type)
    return False


def infer(
    address: str,
    request: InferRequest,
    keys: CurveKeys | None = None,
    *,
    timeout_s: float = 120.0,
) -> InferReply:
    """Run `request` and return the coordinator's reply (chunks of a streamed one are skipped).

    Raises:
        InferUnanswered: If the reply has not come within `timeout_s`.
        InferRefused: If the coordinator refused the message itself.

    """
    with closing(stream_infer(address, request, keys, timeout_s=timeout_s)) as answers:
        for answer in answers:
            if isinstance(answer, InferReply):
                return answer
    raise InferUnanswered(f"the coordinator at {address} ended the stream without a reply")
