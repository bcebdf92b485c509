"""The requester's side of serving against a scripted coordinator on a real ZeroMQ ROUTER."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from common.codec import Limits, recv_message, send_message
from common.messages import JobReply, Message
from common.serving_messages import InferChunk, InferReply, InferRequest
from services.lib.infer_client import InferRefused, InferUnanswered, infer, stream_infer

REQUEST = InferRequest(serve_id="gpt", ids=[1, 2], new_tokens=3, stream=True)
Script = Callable[[InferRequest], list[Message]]


@pytest.fixture
def coordinator() -> Iterator[Callable[[Script], str]]:
    """A ROUTER that answers one request with what a script says, from its own thread."""
    ctx: zmq.Context[Any] = zmq.Context()
    threads: list[threading.Thread] = []

    def start(script: Script) -> str:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")

        def serve() -> None:
            try:
                if sock.poll(10_000):
                    _, env = recv_message(sock, Limits(), routed=True)
                    assert isinstance(env.msg, InferRequest)
                    for msg in script(env.msg):
                        send_message(sock, msg, "coordinator", route=env.route)
            finally:
                sock.close(0)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return f"tcp://127.0.0.1:{port}"

    yield start
    for thread in threads:
        thread.join(15)
    ctx.term()


def test_chunks_then_the_reply_and_strangers_are_skipped(coordinator) -> None:
    def script(req: InferRequest) -> list[Message]:
        return [
            InferChunk(serve_id="other", request=9, tokens=[0]),  # not this request's
            InferChunk(serve_id=req.serve_id, request=1, tokens=[7]),
            InferChunk(serve_id=req.serve_id, request=1, tokens=[8, 9]),
            InferReply(serve_id=req.serve_id, request=1, ok=True, tokens=[7, 8, 9]),
        ]

    got = list(stream_infer(coordinator(script), REQUEST, timeout_s=10))
    assert [type(a).__name__ for a in got] == ["InferChunk", "InferChunk", "InferReply"]
    assert [a.tokens for a in got] == [[7], [8, 9], [7, 8, 9]]


def test_infer_returns_the_reply_alone(coordinator) -> None:
    def script(req: InferRequest) -> list[Message]:
        chunk = InferChunk(serve_id=req.serve_id, request=1, tokens=[7])
        return [chunk, InferReply(serve_id=req.serve_id, request=1, ok=True, tokens=[7])]

    reply = infer(coordinator(script), REQUEST, timeout_s=10)
    assert reply.ok and reply.tokens == [7]


def test_a_refusal_of_the_message_itself_is_raised(coordinator) -> None:
    address = coordinator(lambda req: [JobReply(job_id="", ok=False, error="not your role")])
    with pytest.raises(InferRefused, match="not your role"):
        infer(address, REQUEST, timeout_s=10)


def test_a_coordinator_that_never_answers_is_named_busy(coordinator) -> None:
    address = coordinator(lambda req: [])
    with pytest.raises(InferUnanswered, match="busy"):
        infer(address, REQUEST, timeout_s=0.5)


def test_no_coordinator_at_all_is_named_absent() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(InferUnanswered, match="no coordinator answered"):
        infer(f"tcp://127.0.0.1:{port}", REQUEST, timeout_s=0.3)
