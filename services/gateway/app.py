"""The HTTP routes: OpenAI's models, completions and chat completions over the served model.

Each request is checked in the order that costs least first: its key, its
body's size, its fields, its model, its tokens against the model's positions;
only then is it admitted (`backend.Gate`, 429 beyond the bound) and sent. An
answer is whole (JSON) or streamed as server-sent events, ending ``data:
[DONE]``; an error after a stream began arrives as an event with OpenAI's error
object, which its clients raise. A client that leaves mid-stream only ends its
own response: the request's thread finishes the exchange by itself.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.errors import ConfigError
from common.logging import get_logger
from common.serving_messages import MAX_WAIT_S, InferChunk, InferReply, InferRequest
from services.gateway.backend import GatewayError, Streamer, refusal_error
from services.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    Usage,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    first_error,
    new_id,
)
from services.gateway.served import Resolver, ServedModel
from services.gateway.settings import key_matches
from services.gateway.stops import StopText
from services.lib.text import MAX_STOP_IDS

__all__ = ["Limits", "create_app"]

log = get_logger(__name__)


Piece = tuple[str, str | None, int]
"""A piece of the answer's text, its finish reason (None before the end), tokens so far."""


@dataclass(frozen=True)
class Limits:
    """What the routes bound: the keys they accept and what one request may ask."""

    api_keys: tuple[str, ...]
    max_body_bytes: int
    timeout_s: float
    default_max_tokens: int


@dataclass(frozen=True)
class _Job:
    """A checked request, ready to send: its ids, its limits, how to present the answer."""

    served: ServedModel
    request: InferRequest
    stops: list[str]
    chat: bool
    include_usage: bool

    @property
    def model(self) -> str:
        """The model's name in answers."""
        return self.served.name


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status
    )


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


async def _body(request: Request, limit: int) -> Any:
    """The request's JSON body, read up to `limit` bytes (413 beyond, 400 if not JSON)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"the body is {declared} bytes, over the {limit} taken")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise GatewayError(413, f"the body is over the {limit} bytes taken")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the body is not JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the parser's stack: no request looks so
        raise _bad("the body is not JSON a request could be: nested too deep") from None


def _stop_ids(served: ServedModel, stops: list[str]) -> list[int]:
    """The EOS ids, with each stop string that is one token of its own (e.g. ``<|im_end|>``)."""
    ids = list(served.text.eos_ids)
    for text in stops:
        token = served.text.tokenizer.token_to_id(text)
        if token is not None and token < served.vocab_size:
            ids.append(int(token))
    return list(dict.fromkeys(ids))[:MAX_STOP_IDS]


def _prepare(served: ServedModel, body: ChatRequest | CompletionRequest, limits: Limits) -> _Job:
    """The InferRequest for `body`, or the 400/404 that refuses it."""
    if not served.answers_to(body.model):
        raise GatewayError(
            404, f"the model {body.model!r} is not served here; this gateway serves "
            f"{served.name!r}", param="model", code="model_not_found",
        )  # fmt: skip
    where = "messages" if isinstance(body, ChatRequest) else "prompt"
    try:
        if isinstance(body, ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids, wanted = served.text.encode_chat(messages), body.wanted_tokens()
        else:
            prompt = body.text_or_ids()
            ids = served.text.encode(prompt) if isinstance(prompt, str) else prompt
            wanted = body.max_tokens
    except ConfigError as exc:
        raise _bad(str(exc), where) from None
    if not ids:
        raise _bad("the prompt is empty", "prompt")
    if any(not 0 <= i < served.vocab_size for i in ids):
        raise _bad(f"token ids must be in [0, {served.vocab_size})", "prompt")
    room = served.max_positions - len(ids)
    if room < 1:
        raise _bad(
            f"the prompt is {len(ids)} tokens; the model takes {served.max_positions} positions "
            "and must generate at least one", where,
        )  # fmt: skip
    if wanted is not None and wanted > room:
        raise _bad(
            f"the model's context is {served.max_positions} tokens: {len(ids)} in the prompt "
            f"leave room for {room} to generate, not {wanted}", "max_tokens",
        )  # fmt: skip
    new_tokens = wanted if wanted is not None else min(limits.default_max_tokens, room)
    stops = body.stop_strings()
    request = InferRequest(
        serve_id=served.serve_id,
        ids=ids,
        new_tokens=new_tokens,
        logits=False,
        wait_s=min(max(limits.timeout_s * 0.8, 0.1), MAX_WAIT_S),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        stop=_stop_ids(served, stops),
        stream=body.stream,
    )
    chat = isinstance(body, ChatRequest)
    return _Job(served, request, stops, chat, body.include_usage())


async def _generate(
    streamer: Streamer, resolver: Resolver, job: _Job, timeout_s: float
) -> AsyncIterator[Piece]:
    """The answer's pieces as they come."""
    decoder = job.served.text.decoder()
    stops = StopText(job.stops)
    count = 0
    async for item in streamer.run(job.request, timeout_s):
        if isinstance(item, InferReply):
            if not item.ok:
                if "no serving job" in item.error:
                    resolver.forget()  # the job went away: look again next time
                raise refusal_error(item)
            # a reply's tokens are all of them; the chunks (if any) were its first ones
            piece = stops.feed(decoder.push(item.tokens[count:]) + decoder.flush())
            piece += stops.finish()
            finish = "stop" if stops.stopped or item.finish_reason == "stop" else "length"
            yield piece, finish, len(item.tokens)
            return
        if isinstance(item, InferChunk):
            count += len(item.tokens)
            piece = stops.feed(decoder.push(item.tokens))
            if stops.stopped:
                yield piece, "stop", count
                return
            if piece:
                yield piece, None, count


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


async def _then(first: Piece | None, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """`first` (when there is one) followed by `rest`."""
    if first is not None:
        yield first
    async for piece in rest:
        yield piece


async def _stream(job: _Job, pieces: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
    """The answer as server-sent events."""
    rid, created, model = (
        new_id("chatcmpl" if job.chat else "cmpl"),
        int(time.time()),
        job.served.name,
    )
    count = 0
    if job.chat:
        yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    try:
        async for piece, finish, seen in pieces:
            count = seen
            if job.chat:
                if piece:
                    yield _sse(chat_chunk(rid, model, created, {"content": piece}))
                if finish is not None:
                    yield _sse(chat_chunk(rid, model, created, finish=finish))
            elif piece or finish is not None:
                yield _sse(completion_chunk(rid, model, created, piece, finish))
        if job.include_usage:
            usage = Usage(prompt_tokens=len(job.request.ids), completion_tokens=count)
            make = chat_chunk if job.chat else completion_chunk
            yield _sse(make(rid, model, created, usage=usage))
    except GatewayError as exc:  # the status is sent already: say it in the stream
        yield _sse(error_body(exc.message, exc.kind, exc.param, exc.code))
    yield _sse("[DONE]")


async def _whole(job: _Job, pieces: AsyncIterator[Piece]) -> Response:
    """The answer as one JSON object."""
    texts, finish, count = [], "length", 0
    async for piece, end, seen in pieces:
        texts.append(piece)
        count = seen
        finish = end or finish
    usage = Usage(prompt_tokens=len(job.request.ids), completion_tokens=count)
    make = chat_response if job.chat else completion_response
    rid = new_id("chatcmpl" if job.chat else "cmpl")
    return JSONResponse(make(rid, job.model, "".join(texts), finish, usage))


def create_app(streamer: Streamer, resolver: Resolver, limits: Limits) -> Starlette:
    """The gateway's ASGI app over `streamer` (the coordinator) and `resolver` (the model)."""

    def authorised(request: Request) -> None:
        if not limits.api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(given.strip(), list(limits.api_keys)):
            raise GatewayError(
                401,
                "a valid API key is needed: send `Authorization: Bearer KEY`",
                "authentication_error",
                code="invalid_api_key",
            )

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                authorised(request)
                return await handler(request)
            except GatewayError as exc:
                if exc.status >= 500:
                    log.warning("request failed", status=exc.status, error=exc.message)
                return _error(exc)

        return run

    async def generate(request: Request, kind: type[ChatRequest | CompletionRequest]) -> Response:
        raw = await _body(request, limits.max_body_bytes)
        try:
            body = kind.model_validate(raw)
        except ValidationError as exc:
            message, param = first_error(exc)
            raise _bad(message, param) from None
        served = await resolver.get()
        job = _prepare(served, body, limits)
        pieces = _generate(streamer, resolver, job, limits.timeout_s)
        if not body.stream:
            return await _whole(job, pieces)
        # the first piece before the status: a refusal (429, 503) is still an HTTP error
        first = await anext(pieces, None)
        events = _stream(job, _then(first, pieces))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def chat(request: Request) -> Response:
        return await generate(request, ChatRequest)

    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    def card(served: ServedModel) -> dict[str, Any]:
        return {"id": served.name, "object": "model", "created": 0, "owned_by": "asteroid-edge"}

    async def models(request: Request) -> Response:
        try:
            served = await resolver.get()
        except GatewayError:
            return JSONResponse({"object": "list", "data": []})
        return JSONResponse({"object": "list", "data": [card(served)]})

    async def model(request: Request) -> Response:
        served = await resolver.get()
        if not served.answers_to(str(request.path_params["model"])):
            raise GatewayError(404, "no such model here", param="model", code="model_not_found")
        return JSONResponse(card(served))

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "in_flight": streamer.gate.held})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
    ]
    return Starlette(routes=routes)
