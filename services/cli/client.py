"""The CLI's side of the control plane: one request to the coordinator, one reply.

A DEALER with a fresh identity per call (never REQ: a dead coordinator must
not wedge the socket), and a timeout that names the address it tried.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, cast

import zmq

from common.codec import Envelope, Limits, recv_message, send_message
from common.curve import load_keys
from common.errors import AsteroidError, ProtocolError, Unreachable
from common.messages import JobReply, Message
from services.lib.infer_client import operator_dealer

__all__ = ["CoordinatorUnreachable", "RequestRefused", "ask_coordinator", "request"]


class CoordinatorUnreachable(Unreachable):
    """No reply from the coordinator in time."""


class RequestRefused(AsteroidError):
    """The coordinator answered a request with a refusal instead of the answer awaited."""


def ask_coordinator(address: str, msg: Message, timeout_s: float = 15.0) -> JobReply:
    """Send `msg` to the coordinator at `address` and return its JobReply."""
    return cast(JobReply, request(address, msg, JobReply, timeout_s).msg)


def request(address: str, msg: Message, answer: type[Message], timeout_s: float = 15.0) -> Envelope:
    """Send `msg` to the coordinator at `address`; the first reply of kind `answer`.

    The whole envelope comes back, so an answer's tensor frames (an inference's
    logits) come with it. With ASTEROID_KEYS set (the key set holding this
    operator's one secret key), the request goes over CURVE as that operator,
    identity NAME/SESSION.
    """
    limits = Limits()
    keys_dir = os.environ.get("ASTEROID_KEYS")
    keys = load_keys(Path(keys_dir) if keys_dir else None, "operator")
    ctx: zmq.Context[Any] = zmq.Context()
    sock = operator_dealer(ctx, address, keys, "cli")
    monitor = sock.get_monitor_socket()
    try:
        send_message(sock, msg, "cli")
        deadline = time.monotonic() + timeout_s
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            try:
                _, env = recv_message(sock, limits)
            except ProtocolError:
                continue
            if isinstance(env.msg, answer):
                return env
            if isinstance(env.msg, JobReply) and not env.msg.ok:  # refused before any answer
                raise RequestRefused(f"the coordinator refused the {msg.type}: {env.msg.error}")
        if monitor.poll(0, zmq.POLLIN):  # it is there, only busy
            raise CoordinatorUnreachable(
                f"the coordinator at {address} took the {msg.type} but did not answer within "
                f"{timeout_s:.0f} s: it is busy (requests wait their turn); wait longer "
                "(--timeout) or try again later"
            )
        raise CoordinatorUnreachable(
            f"no coordinator answered at {address} within {timeout_s:.0f} s "
            "(is asteroid-coordinator running there? see --coordinator)"
        )
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()
