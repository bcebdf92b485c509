"""The gateway's side of the coordinator: admitted requests, their threads, their HTTP errors.

A request to the coordinator is a blocking ZeroMQ exchange (`services.lib.infer_client`),
so each admitted request runs on a (daemon) thread of its own and hands what it receives
(`InferChunk`s, then the `InferReply`) to the HTTP side's event loop. `Gate` bounds
how many are admitted: a request over the bound is refused at once (429), since a
queue without end only turns a burst into timeouts. A slot is held until the
coordinator has answered, even when the HTTP client went away: the coordinator is
still working on it, and it counts against the gateway's share of its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from common.errors import AsteroidError
from common.logging import get_logger
from common.serving_messages import InferChunk, InferReply, InferRequest

__all__ = ["Gate", "GatewayError", "Infer", "Streamer", "refusal_error"]

log = get_logger(__name__)

Infer = Callable[[InferRequest, float], Iterator[InferChunk | InferReply]]
"""Send a request, yield its chunks then its reply (blocking); the timeout in seconds."""
MARGIN_S = 5.0
"""Beyond the client's own timeout, how long the HTTP side waits for the thread's word."""


@dataclass(frozen=True)
class GatewayError(Exception):
    """A request the gateway answers with an HTTP error (OpenAI's error shape)."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def refusal_error(reply: InferReply) -> GatewayError:
    """The HTTP error for the coordinator's refusal `reply` (ok false), by its `refusal`.

    No serving job, or it ended before the request ran: 503; the requester's queue
    full: 429; the wait over: 504; the model cannot take it: 400; it ran and failed
    (or the coordinator gave no reason): 502.
    """
    error = reply.error or "the coordinator refused the request"
    status, kind, code = _REFUSALS.get(reply.refusal or "failed", _REFUSALS["failed"])
    return GatewayError(status, error, kind, code=code)


_REFUSALS: dict[str, tuple[int, str, str | None]] = {
    "no_job": (503, "service_unavailable_error", "no_serving_job"),
    "ended": (503, "service_unavailable_error", "serving_job_ended"),
    "busy": (429, "rate_limit_error", "coordinator_queue_full"),
    "late": (504, "timeout_error", "timeout"),
    "invalid": (400, "invalid_request_error", None),
    "failed": (502, "server_error", "serving_failed"),
}
"""HTTP status, OpenAI error type and code of each `InferReply.refusal`."""


class Gate:
    """At most `size` requests admitted at once; the rest refused at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Requests admitted and not yet answered by the coordinator."""
        return self._held

    def enter(self) -> None:
        """Admit one request, or raise the 429 that refuses it."""
        with self._lock:
            if self._held >= self.size:
                raise GatewayError(
                    429,
                    f"the gateway already has {self.size} requests in flight; try again later",
                    "rate_limit_error",
                    code="queue_full",
                )
            self._held += 1

    def leave(self) -> None:
        """A request's slot back (the coordinator answered it, or it failed)."""
        with self._lock:
            self._held -= 1


_DONE = object()


class Streamer:
    """Runs admitted requests on threads and streams what they receive to the event loop."""

    def __init__(self, infer: Infer, gate: Gate) -> None:
        self.infer = infer
        self.gate = gate
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop taking requests.

        A thread still waiting on the coordinator ends by its timeout, or with the
        process: the threads are daemons, so a stop never waits on a coordinator
        that went away.
        """
        self._closed.set()

    async def run(
        self, request: InferRequest, timeout_s: float
    ) -> AsyncIterator[InferChunk | InferReply]:
        """Admit `request` (or 429), send it, yield its chunks and its reply.

        Raises GatewayError: the coordinator unreachable (503) or silent (504).
        Leaving the iteration early (the HTTP client went away) leaves the thread
        to finish the exchange in the background.
        """
        if self._closed.is_set():
            raise GatewayError(503, "the gateway is stopping", "service_unavailable_error")
        self.gate.enter()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        abandoned = threading.Event()

        def put(item: object) -> None:
            if not abandoned.is_set():
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                    loop.call_soon_threadsafe(queue.put_nowait, item)

        def exchange() -> None:
            left = False
            try:
                for item in self.infer(request, timeout_s):
                    if isinstance(item, InferReply) and not left:
                        self.gate.leave()  # before the reply: its client may ask again at once
                        left = True
                    put(item)
            except Exception as exc:  # every failure reaches the HTTP side as a value
                put(exc)
            finally:
                if not left:
                    self.gate.leave()
                put(_DONE)

        threading.Thread(target=exchange, name="gateway-infer", daemon=True).start()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout_s + MARGIN_S)
                except asyncio.TimeoutError:
                    raise GatewayError(
                        504, f"no answer within {timeout_s:.0f} s", "timeout_error"
                    ) from None
                if item is _DONE:
                    raise GatewayError(502, "the coordinator closed the exchange without a reply")
                if isinstance(item, Exception):
                    raise _as_gateway_error(item)
                if isinstance(item, InferChunk | InferReply):  # only these are put besides
                    yield item
                if isinstance(item, InferReply):
                    return
        finally:
            abandoned.set()


def _as_gateway_error(exc: Exception) -> GatewayError:
    """The HTTP error for a failed exchange with the coordinator."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, AsteroidError):
        text = str(exc)
        if "did not answer within" in text or "busy" in text:
            return GatewayError(504, text, "timeout_error", code="timeout")
        return GatewayError(503, text, "service_unavailable_error", code="coordinator_unreachable")
    log.error("the exchange with the coordinator failed", error=repr(exc))
    return GatewayError(502, f"the exchange with the coordinator failed: {exc!r}", "server_error")
