"""OpenAI's request bodies as bounded models, and its response shapes.

Clients send many fields this server has no use for (`user`, `metadata`,
penalties at their defaults); those are ignored, as local-LLM servers do. A
field asking for something not done here (several choices, log-probabilities,
tools, echo) is refused with 400 rather than silently answered without it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from common.serving_messages import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_TEMPERATURE
from services.lib.text import MAX_MESSAGES, MAX_TEXT_CHARS

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "Usage",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "first_error",
    "new_id",
]

MAX_STOP_STRINGS = 4
"""OpenAI's bound on `stop` strings."""
MAX_STOP_CHARS = 64
"""Longest stop string."""
MAX_NAME = 256
"""Longest model name or message name."""


class _Body(BaseModel):
    """A request body: unknown fields ignored, every known one bounded."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(_Body):
    """One part of a message's content; only text is served."""

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatMessage(_Body):
    """A chat message; the template decides which roles and orders it accepts."""

    role: str = Field(pattern=r"^[a-z_]{1,32}$")
    content: str | list[TextPart] | None = Field(None, max_length=MAX_TEXT_CHARS)
    name: str | None = Field(None, max_length=MAX_NAME)

    def text(self) -> str:
        """The content as one text (parts joined, none as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Generation(_Body):
    """What both endpoints take: the model, sampling, stops, streaming."""

    model: str = Field(min_length=1, max_length=MAX_NAME)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    logprobs: Any = None

    @model_validator(mode="after")
    def _supported(self) -> _Generation:
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not served here")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters"
            )
        return self

    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Generation):
    """A ``/v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _no_tools(self) -> ChatRequest:
        if self.tools:
            raise ValueError("tools are not served here")
        return self

    def wanted_tokens(self) -> int | None:
        """The most tokens to generate, under either of OpenAI's names for it."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    """A ``/v1/completions`` body: a prompt as text or as token ids (one prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not served here")
        listed = isinstance(self.prompt, list) and self.prompt
        if listed and isinstance(self.prompt[0], str | list) and len(self.prompt) != 1:
            raise ValueError("one prompt per request")
        one = self.text_or_ids()
        limit = MAX_TEXT_CHARS if isinstance(one, str) else MAX_PROMPT_TOKENS
        if len(one) > limit:
            raise ValueError(f"a prompt of {len(one)} is over the {limit} taken")
        return self

    def text_or_ids(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0] if prompt else None
        if isinstance(first, str | list):  # one prompt in a list (the validator checked)
            return first
        return cast(list[int], prompt)


def first_error(exc: ValidationError) -> tuple[str, str | None]:
    """The first complaint of a body's validation, and the field it names (OpenAI's `param`)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if not isinstance(p, int) or p != 0)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), (where or None)


class Usage(BaseModel):
    """Token counts of one answer."""

    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        """OpenAI's `usage` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {**self.model_dump(), "total_tokens": total}


def new_id(prefix: str) -> str:
    """An answer's id, e.g. ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _head(rid: str, kind: str, model: str, created: int | None) -> dict[str, Any]:
    stamp = int(time.time()) if created is None else created
    return {"id": rid, "object": kind, "created": stamp, "model": model}


def chat_response(
    rid: str, model: str, text: str, finish: str, usage: Usage, created: int | None = None
) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return {**_head(rid, "chat.completion", model, created), "choices": [choice],
            "usage": usage.body()}  # fmt: skip


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, str] | None = None,
    finish: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``: a delta, the finish, or (with usage) the last one."""
    out = _head(rid, "chat.completion.chunk", model, created)
    if usage is not None:
        return {**out, "choices": [], "usage": usage.body()}
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
    return {**out, "choices": [choice]}


def completion_response(
    rid: str, model: str, text: str, finish: str, usage: Usage, created: int | None = None
) -> dict[str, Any]:
    """A whole ``text_completion``."""
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**_head(rid, "text_completion", model, created), "choices": [choice],
            "usage": usage.body()}  # fmt: skip


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str = "",
    finish: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion``: a piece of text, the finish, or the usage."""
    out = _head(rid, "text_completion", model, created)
    if usage is not None:
        return {**out, "choices": [], "usage": usage.body()}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**out, "choices": [choice]}


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, which its clients raise as the matching exception."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
