"""The gateway's HTTP side against an in-process coordinator: OpenAI's shapes, limits, errors."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from common.errors import AsteroidError
from common.serving_messages import MAX_NEW_TOKENS
from tests.gateway.fakes import ANSWER, KEY, FakeCoordinator, client, make_app, served_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "what does the fox do?"}]}


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def events(body: str) -> list[Any]:
    """The data of each server-sent event; [DONE] as the string."""
    out = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture
def served(tmp_path):
    return served_model(tmp_path)


def test_a_chat_is_answered_whole_in_openai_shape(served):
    fake = FakeCoordinator(served)
    app, _ = make_app(served, fake)

    async def go() -> None:
        async with client(app) as http:
            got = await http.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["id"].startswith("chatcmpl-")
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": ANSWER}
        assert choice["finish_reason"] == "length"
        (sent,) = fake.seen
        assert sent.ids == served.text.encode_chat(CHAT["messages"])
        assert sent.new_tokens == 32 and sent.temperature == 0 and not sent.stream
        assert sent.stop == list(served.text.eos_ids) and sent.stop
        usage = body["usage"]
        assert usage == {
            "prompt_tokens": len(sent.ids),
            "completion_tokens": len(fake.tokens),
            "total_tokens": len(sent.ids) + len(fake.tokens),
        }

    run(go)


def test_a_streamed_chat_joins_to_the_whole_answer_and_ends_with_done(served):
    fake = FakeCoordinator(served)
    fake.stop_token = 1
    app, _ = make_app(served, fake)

    async def go() -> None:
        async with client(app) as http:
            body = {**CHAT, "stream": True, "max_tokens": 30, "seed": 7}
            body["stream_options"] = {"include_usage": True}
            got = await http.post("/v1/chat/completions", json=body)
        assert got.status_code == 200 and got.headers["content-type"].startswith(
            "text/event-stream"
        )
        *chunks, usage, done = events(got.text)
        assert done == "[DONE]"
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == ANSWER
        assert len(chunks) > 4  # streamed in pieces, not at the end
        assert chunks[-1]["choices"][0] == {
            "index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None
        }  # fmt: skip
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(fake.tokens)
        (sent,) = fake.seen
        assert sent.stream and sent.seed == 7 and sent.new_tokens == 30

    run(go)


def test_completions_take_text_or_ids_and_stream_text_completions(served):
    fake = FakeCoordinator(served)
    app, _ = make_app(served, fake)

    async def go() -> None:
        async with client(app) as http:
            whole = await http.post(
                "/v1/completions", json={"model": "chat-1", "prompt": "the fox", "max_tokens": 5}
            )
            ids = await http.post(
                "/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7]], "stream": True}
            )
        assert whole.status_code == 200, whole.text
        body = whole.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == served.text.decode(fake.tokens[:5])
        assert fake.seen[0].ids == served.text.encode("the fox") and fake.seen[0].new_tokens == 5
        chunks = events(ids.text)
        assert chunks[-1] == "[DONE]"
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ANSWER[: len(
            served.text.decode(fake.tokens[:16])
        )]  # fmt: skip
        assert fake.seen[1].ids == [5, 6, 7] and fake.seen[1].new_tokens == 16  # OpenAI's default

    run(go)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_before_it(served, stream):
    fake = FakeCoordinator(served)
    app, _ = make_app(served, fake)

    async def go() -> None:
        async with client(app) as http:
            got = await http.post(
                "/v1/chat/completions", json={**CHAT, "stop": ["fox", "zzz"], "stream": stream}
            )
        if stream:
            chunks = events(got.text)[:-1]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = got.json()["choices"][0]["message"]["content"]
            finish = got.json()["choices"][0]["finish_reason"]
        assert text == "the quick brown " and finish == "stop"

    run(go)


def test_models_health_and_the_api_key(served):
    app, _ = make_app(served, FakeCoordinator(served))

    async def go() -> None:
        async with client(app) as http:
            models = await http.get("/v1/models")
            one = await http.get("/v1/models/tiny")
            other = await http.get("/v1/models/gpt-4")
            health = await http.get("/health", headers={"Authorization": ""})
            none = await http.get("/v1/models", headers={"Authorization": ""})
            wrong = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}
            )
        assert models.json()["data"][0]["id"] == "tiny"
        assert one.json()["id"] == "tiny" and other.status_code == 404
        assert health.json()["status"] == "ok"
        for got in (none, wrong):
            assert got.status_code == 401
            assert got.json()["error"]["type"] == "authentication_error"
            assert KEY not in got.text

    run(go)


BAD = [
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "max_tokens": MAX_NEW_TOKENS + 1}, "max_tokens"),
    ({**CHAT, "max_tokens": 60}, "max_tokens"),  # prompt + 60 > the 64 positions
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages"),  # the template's
    ({**CHAT, "messages": [{"role": "user", "content": "fox " * 100}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({**CHAT, "logprobs": True}, None),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, None),
    ({"model": "tiny", "prompt": [1, 100000]}, "prompt"),
    ({"model": "tiny", "prompt": ["one", "two"]}, None),
    ({"model": "tiny", "prompt": list(range(9000))}, None),
    ({"model": "tiny", "prompt": "fox " * 3000}, "prompt"),  # past the positions, not the chars
    ({"model": "tiny"}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_requests_get_400_in_openai_shape(served, body, param):
    fake = FakeCoordinator(served)
    app, _ = make_app(served, fake)
    path = "/v1/chat/completions" if "messages" in body or "n" in body else "/v1/completions"
    if "prompt" not in body and "messages" not in body:
        path = "/v1/completions"

    async def go() -> None:
        async with client(app) as http:
            got = await http.post(path, json=body)
        assert got.status_code == 400, got.text
        error = got.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if param is not None:
            assert error["param"].startswith(param), error
        assert fake.seen == []  # refused before reaching the coordinator

    run(go)


def test_unknown_model_oversized_and_malformed_bodies(served):
    app, _ = make_app(served, FakeCoordinator(served), body=2000)

    async def go() -> None:
        async with client(app) as http:
            unknown = await http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
            big = await http.post("/v1/chat/completions", content=b"{" + b" " * 4000 + b"}")
            broken = await http.post("/v1/chat/completions", content=b"{not json")
            deep = await http.post("/v1/chat/completions", content=b"[" * 900 + b"]" * 900)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert big.status_code == 413
        assert broken.status_code == 400 and "not JSON" in broken.json()["error"]["message"]
        assert deep.status_code == 400

    run(go)


@pytest.mark.parametrize(
    ("error", "refusal", "status"),
    [
        ("no serving job chat-1 is running here (running: None)", "no_job", 503),
        ("serving job chat-1 ended: cancelled (by alice)", "ended", 503),
        ("16 requests of gw already wait; try again later (serving job chat-1)", "busy", 429),
        ("waited 240.0 s for its turn", "late", 504),
        ("token ids must be in [0, 300)", "invalid", 400),
        ("device b was lost", "failed", 502),
        ("an older coordinator gives no reason", None, 502),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_coordinator_refusals_become_http_errors(served, error, refusal, status, stream):
    fake = FakeCoordinator(served)
    fake.refuse, fake.refusal = error, refusal
    app, _ = make_app(served, fake)

    async def go() -> None:
        async with client(app) as http:
            got = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert got.status_code == status, got.text
        assert got.json()["error"]["message"] == error

    run(go)


def test_an_unreachable_coordinator_or_no_serving_job_is_503(served, tmp_path):
    fake = FakeCoordinator(served)
    fake.raise_error = AsteroidError("no coordinator answered at tcp://127.0.0.1:1 within 5 s")
    app, _ = make_app(served, fake)
    empty, _ = make_app(None, fake)

    async def go() -> None:
        async with client(app) as http:
            away = await http.post("/v1/chat/completions", json=CHAT)
        async with client(empty) as http:
            none = await http.post("/v1/chat/completions", json=CHAT)
            models = await http.get("/v1/models")
        assert away.status_code == 503 and "no coordinator answered" in away.text
        assert none.status_code == 503
        assert none.json()["error"]["type"] == "service_unavailable_error"
        assert models.json() == {"object": "list", "data": []}

    run(go)


def test_past_the_queue_bound_requests_are_refused_at_once_and_the_rest_complete(served):
    fake = FakeCoordinator(served)
    fake.hold = threading.Event()
    app, streamer = make_app(served, fake, queue=2)

    async def go() -> None:
        async with client(app) as http:
            admitted = [asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
                        for _ in range(2)]  # fmt: skip
            for _ in range(3000):  # both admitted within 30 s
                if streamer.gate.held == 2:
                    break
                await asyncio.sleep(0.01)
            assert streamer.gate.held == 2
            flood = await asyncio.gather(
                *(http.post("/v1/chat/completions", json=CHAT) for _ in range(18))
            )
            assert {r.status_code for r in flood} == {429}
            assert flood[0].json()["error"]["code"] == "queue_full"
            fake.hold.set()
            done = await asyncio.gather(*admitted)
            assert [r.status_code for r in done] == [200, 200]
            again = await http.post("/v1/chat/completions", json=CHAT)
            assert again.status_code == 200  # the slots came back
        assert streamer.gate.held == 0

    run(go)
