"""An in-process stand-in for the coordinator and the served model, for the HTTP tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from common.serving_messages import InferChunk, InferReply, InferRequest, Refusal
from services.gateway.app import Limits, create_app
from services.gateway.backend import Gate, Streamer
from services.gateway.served import Resolver, ServedModel
from services.lib.text import load_text
from tests.gateway.folders import write_folder

KEY = "sk-test-key"
ANSWER = "the quick brown fox jumps over the lazy dog"


class FakeCoordinator:
    """Answers every request with the ids of `answer`, chunk by chunk when it streams.

    `refuse` answers with that error instead; `hold` makes each exchange wait
    for the event (a request in flight); `seen` keeps every request sent.
    """

    def __init__(self, served: ServedModel, answer: str = ANSWER) -> None:
        self.tokens = served.text.encode(answer, special=False)
        self.refuse: str | None = None
        self.refuse_request = 0
        self.refusal: Refusal | None = None
        self.raise_error: Exception | None = None
        self.hold: threading.Event | None = None
        self.seen: list[InferRequest] = []
        self.stop_token: int | None = None

    def __call__(
        self, request: InferRequest, timeout_s: float
    ) -> Iterator[InferChunk | InferReply]:
        self.seen.append(request)
        if self.hold is not None:
            self.hold.wait(timeout_s)
        if self.raise_error is not None:
            raise self.raise_error
        if self.refuse is not None:
            yield InferReply(
                serve_id=request.serve_id,
                request=self.refuse_request,
                ok=False,
                error=self.refuse,
                refusal=self.refusal,
            )
            return
        tokens = self.tokens[: request.new_tokens]
        finish = "length"
        if self.stop_token is not None and len(self.tokens) < request.new_tokens:
            finish = "stop"  # the stop token came after these, and is left out
        if request.stream:
            for i in range(0, len(tokens), 2):
                yield InferChunk(serve_id=request.serve_id, request=1, tokens=tokens[i : i + 2])
        yield InferReply(
            serve_id=request.serve_id, request=1, ok=True, tokens=tokens, finish_reason=finish
        )


def served_model(tmp: Path, positions: int = 64) -> ServedModel:
    text = load_text(write_folder(tmp / "model"))
    return ServedModel(
        serve_id="chat-1", name="tiny", text=text, max_positions=positions, vocab_size=512
    )


def make_app(
    served: ServedModel | None, fake: Any, queue: int = 4, body: int = 1 << 16
) -> tuple[Any, Streamer]:
    def find() -> ServedModel:
        if served is None:
            from services.gateway.backend import GatewayError

            raise GatewayError(503, "no serving job is running", "service_unavailable_error")
        return served

    streamer = Streamer(fake, Gate(queue))
    limits = Limits(api_keys=(KEY,), max_body_bytes=body, timeout_s=30, default_max_tokens=32)
    return create_app(streamer, Resolver(find), limits), streamer


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://gateway",
        headers={"Authorization": f"Bearer {KEY}"},
    )
