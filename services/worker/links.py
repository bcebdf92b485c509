"""The worker's side of link measurement: probe peers' bandwidth sinks when asked.

The coordinator sends MeasureLinks between rounds; the probes run on a thread
of their own so that neither the control link's heartbeats nor the main
thread's commands wait for them, and the answer (LinksMeasured) goes back
through the control link. One measurement at a time: a request that arrives
while one runs is answered at once with an error for each of its targets.
Every probe is bounded by the request's timeout, so the whole measurement is
bounded by the number of targets times that timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zmq

from common.curve import CurveKeys
from common.errors import AsteroidError
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import LinksMeasured, MeasureLinks, Message
from services.worker.bandwidth import probe_link

__all__ = ["LinkProber", "measure"]

log = get_logger(__name__)
ERROR_MAX = 500
"""Characters of an error kept in LinksMeasured (the message's own bound)."""


def measure(
    ctx: zmq.Context[Any], device: DeviceId, req: MeasureLinks, keys: CurveKeys | None
) -> LinksMeasured:
    """Probe each target of `req` in turn; a failed probe becomes that target's error."""
    rates: dict[DeviceId, float] = {}
    errors: dict[DeviceId, str] = {}
    for target, addr in sorted(req.targets.items()):
        try:
            got = probe_link(
                ctx, addr, req.nbytes, req.count, req.timeout_s, keys, target if keys else None
            )
        except (AsteroidError, ValueError, zmq.ZMQError) as exc:
            errors[target] = f"{type(exc).__name__}: {exc}"[:ERROR_MAX]
            log.warning("link probe failed", target=target, addr=addr, error=str(exc))
            continue
        rates[target] = got.bytes_per_s
        log.info("link measured", target=target, mb_per_s=round(got.mb_per_s, 2))
    return LinksMeasured(device=device, nonce=req.nonce, rates=rates, errors=errors)


class LinkProber:
    """Runs one measurement at a time on a daemon thread; `reply` sends its answer."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        device: DeviceId,
        keys: CurveKeys | None,
        reply: Callable[[Message], None],
    ) -> None:
        self.ctx, self.device, self.keys, self.reply = ctx, device, keys, reply
        self._thread: threading.Thread | None = None
        self._running = threading.Event()

    @property
    def busy(self) -> bool:
        """A measurement is under way.

        Not the thread's liveness: the thread sends its answer before it ends, and
        the coordinator's next request may arrive in between (a loaded machine).
        """
        return self._running.is_set()

    def start(self, req: MeasureLinks) -> None:
        """Measure `req` in the background, or refuse it at once if one is under way."""
        if self.busy:
            why = "another link measurement is under way on this worker"
            self.reply(
                LinksMeasured(
                    device=self.device,
                    nonce=req.nonce,
                    errors={target: why for target in req.targets},
                )
            )
            return
        self._running.set()
        self._thread = threading.Thread(
            target=self._run, args=(req,), name="link-prober", daemon=True
        )
        self._thread.start()

    def _run(self, req: MeasureLinks) -> None:
        try:
            answer = measure(self.ctx, self.device, req, self.keys)
        finally:
            self._running.clear()  # free before the answer goes: the next request may follow it
        self.reply(answer)

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for a measurement under way."""
        if self._thread is not None:
            self._thread.join(timeout_s)
