"""Which model the gateway answers with: the serving job, its shape and its folder's text side.

The serving job is `--serve-id`, or the newest running serving job in the job
records; its spec (stored as submitted) gives the model's shape (positions,
vocabulary) and its folder (`path`, or `--model-dir`), whose tokenizer and chat
template turn text into ids. The answer is kept until the coordinator says the
job is gone, then looked up again, so a gateway started before the job, or
left running across a new one, finds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from common.errors import AsteroidError, ConfigError
from common.lifecycle import ACTIVE
from common.records.documents import read_jobspec
from common.records.jobs import read_job, recent_jobs
from common.serving_messages import ServeSpec
from common.store import Store
from services.gateway.backend import GatewayError
from services.lib.text import TextModel, load_text

__all__ = ["Resolver", "ServedModel", "find_served"]


@dataclass(frozen=True)
class ServedModel:
    """What a request needs of the served model.

    Attributes:
        serve_id: The serving job requests go to.
        name: The model's name in the API (`/v1/models`, the `model` field).
        text: Its tokenizer, EOS ids and chat template.
        max_positions: Prompt plus generated tokens may not exceed this.
        vocab_size: Ids the model takes.

    """

    serve_id: str
    name: str
    text: TextModel
    max_positions: int
    vocab_size: int

    def answers_to(self, model: str) -> bool:
        """Whether a request naming `model` is for this one (its name or its serve id)."""
        return model in (self.name, self.serve_id)


def _unavailable(message: str) -> GatewayError:
    return GatewayError(503, message, "service_unavailable_error", code="no_serving_job")


def _running_serve_id(store: Store) -> str:
    """The newest serving job the records show active."""
    for jid in recent_jobs(store):
        record = read_job(store, jid)
        if record is not None and record.kind == "serve" and record.state in ACTIVE:
            return jid
    raise _unavailable("no serving job is running (start one with `asteroid serve`)")


def find_served(
    store: Store, serve_id: str | None, model_dir: Path | None, name: str | None
) -> ServedModel:
    """The served model as the records and its folder describe it.

    Raises GatewayError (503) when no serving job is found, and when its folder
    cannot be read: a request cannot be served without it.
    """
    jid = serve_id or _running_serve_id(store)
    doc = read_jobspec(store, jid)
    if doc is None:
        raise _unavailable(f"serving job {jid} has no spec in the records")
    try:
        spec = ServeSpec.model_validate(doc)
    except ValidationError as exc:
        raise _unavailable(f"serving job {jid}'s spec is not a serving spec: {exc}") from None
    if spec.model is None:
        raise _unavailable(
            f"serving job {jid} serves a training checkpoint whose shape the gateway does not "
            "read; serve a model folder (source: pretrained)"
        )
    path: str | None = getattr(spec, "path", None)  # a pretrained spec's folder
    folder = model_dir or (Path(path) if path else None)
    if folder is None:
        raise _unavailable(
            f"serving job {jid} names no model folder (source {spec.source}); start the gateway "
            "with --model-dir holding the model's tokenizer.json"
        )
    try:
        text = load_text(folder)
    except ConfigError as exc:
        raise _unavailable(f"serving job {jid}: {exc}") from None
    if text.vocab_size > spec.model.vocab_size:
        raise _unavailable(
            f"the tokenizer of {folder} makes ids up to {text.vocab_size - 1}, beyond the "
            f"served model's vocabulary of {spec.model.vocab_size}"
        )
    return ServedModel(
        serve_id=jid,
        name=name or jid,
        text=text,
        max_positions=spec.model.max_positions,
        vocab_size=spec.model.vocab_size,
    )


class Resolver:
    """The served model, looked up once and again after `forget` (the job went away)."""

    def __init__(self, find: Callable[[], ServedModel]) -> None:
        self._find = find
        self._served: ServedModel | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ServedModel:
        """The served model; GatewayError (503) when there is none."""
        async with self._lock:
            if self._served is None:
                try:
                    self._served = await asyncio.to_thread(self._find)
                except AsteroidError as exc:  # Redis away or records malformed
                    raise _unavailable(f"the job records cannot be read: {exc}") from None
            return self._served

    def forget(self) -> None:
        """Look the served model up again at the next request."""
        self._served = None
