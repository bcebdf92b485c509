"""The gateway reaches the coordinator over CURVE as an operator, and refuses to start unsafely."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.codec import Limits, recv_message, send_message
from common.curve import CurveKeys, create_key_set, stop_authenticator
from common.exit_codes import ExitCode
from common.serving_messages import InferChunk, InferReply, InferRequest
from common.sockets import bind_router
from services.gateway.main import coordinator_infer, main

WAIT_MS = 10_000


def test_requests_go_over_curve_as_the_operator_key(tmp_path: Path) -> None:
    create_key_set(tmp_path, operators=["gateway-1"], workers=["w1"])
    ctx: zmq.Context[Any] = zmq.Context()
    server = CurveKeys.load(tmp_path, "coordinator")
    sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), keys=server,
                                 roles=("operator",))  # fmt: skip
    seen: list[str] = []

    def coordinator() -> None:
        if not sock.poll(WAIT_MS):
            return
        peer, env = recv_message(sock, Limits(), routed=True)
        seen.append(peer)
        assert isinstance(env.msg, InferRequest)
        chunk = InferChunk(serve_id=env.msg.serve_id, request=1, tokens=[4])
        reply = InferReply(serve_id=env.msg.serve_id, request=1, ok=True, tokens=[4, 5])
        for msg in (chunk, reply):
            send_message(sock, msg, "coordinator", route=env.route)

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    try:
        infer = coordinator_infer(endpoint, CurveKeys.load(tmp_path, "operator"))
        request = InferRequest(serve_id="chat", ids=[1, 2], new_tokens=2, stream=True)
        answers = list(infer(request, 10.0))
        thread.join(WAIT_MS / 1000)
    finally:
        sock.close(0)
        stop_authenticator(ctx)
        ctx.term()
    assert [type(a) for a in answers] == [InferChunk, InferReply]
    assert seen and seen[0].startswith("gateway-1/")  # known by its key's name


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--http-host", "0.0.0.0"], "give it an API key"),
        (["--keys", "{keys}"], "expected exactly one operator secret key"),
        (["--serve-id", "no/such"], "--serve-id"),
    ],
)
def test_an_unsafe_or_wrong_start_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, args, says
) -> None:
    monkeypatch.delenv("ASTEROID_API_KEY", raising=False)
    monkeypatch.setenv("ASTEROID_REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    with pytest.raises(SystemExit) as done:
        main([a.format(keys=tmp_path) for a in args])
    assert done.value.code == ExitCode.CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asteroid-gateway: error: ") and says in err[0]
