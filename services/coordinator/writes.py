"""The coordinator's Redis writes through an outage: wait for the ones a job needs, keep the rest.

Two kinds of write: a step a running job cannot go past (`durable`: commit a round,
record a state) waits Redis out while the coordinator keeps serving its socket; a
write nothing waits on but that must land (a job's end state, forgetting silent
devices) is kept in order and written once Redis answers again (`write_soon`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

from common.logging import get_logger
from common.secrets import mask_text
from common.store import OUTAGE, REFUSED, Store

__all__ = ["Writes"]

log = get_logger(__name__)
T = TypeVar("T")
FLUSH_EVERY_S = 1.0
"""Least time between two attempts to write what an outage held back."""


class Writes:
    """Redis steps a job waits on, and writes kept until Redis is back."""

    def __init__(self, store: Store, outage_s: float, idle: Callable[[float], None]) -> None:
        """Write to `store`; wait out at most `outage_s`, calling `idle` between attempts."""
        self.store, self.outage_s, self.idle = store, outage_s, idle
        self.unwritten: deque[tuple[str, Callable[[], object]]] = deque()
        """Writes Redis missed during an outage that must still land, oldest first."""
        self._next_flush = 0.0

    def durable(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, the Redis step a job needs before it goes on, waiting out an outage.

        While Redis is away the coordinator keeps answering its socket (heartbeats,
        submits, cancels) between attempts (`idle`), so a running job pauses where
        it is (at a round boundary: no round starts before the last one is
        committed) and resumes when Redis is back, or fails with StoreUnavailable
        after `outage_s`.
        """
        return self.store.ride_out(op, what, self.outage_s, idle=self.idle)

    def write_soon(self, what: str, op: Callable[[], object]) -> None:
        """`op()` now, or once Redis is back: for writes nothing waits on but that must land.

        A job that ends during an outage must not stay `running` in Redis while
        this coordinator lives: its end state is kept and written by `flush` as
        soon as Redis answers again, in order.
        """
        if not self.unwritten:
            try:
                op()
                return
            except OUTAGE as exc:
                log.warning(
                    "Redis unreachable; will write when it is back",
                    write=what,
                    redis=self.store.where,
                    error=mask_text(str(exc)),
                )
            except REFUSED as exc:  # full, say: it may take the write once room is made
                log.warning(
                    "Redis refused a write; will try again",
                    write=what,
                    redis=self.store.where,
                    error=mask_text(str(exc)),
                )
        self.unwritten.append((what, op))

    def flush(self, now: float) -> None:
        """Write what an outage held back, oldest first; stop at the first failure."""
        if not self.unwritten or now < self._next_flush:
            return
        self._next_flush = now + FLUSH_EVERY_S
        while self.unwritten:
            what, op = self.unwritten[0]
            try:
                op()
            except (*OUTAGE, *REFUSED):
                return
            self.unwritten.popleft()
            log.info("wrote what Redis missed", write=what)
