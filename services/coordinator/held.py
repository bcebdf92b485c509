"""A run's commands held behind a Redis step an outage refused, carried out in order once it lands.

A Redis step a job needs (commit a round, record a state) is tried once
(`once`); an outage does not block the coordinator's loop inside it. The step
is held, with every command after it, because order matters: no round may
start before the last one is committed. The core is told (`StoreDown`) and
decides what the outage means; the held step is tried again at most once a
second, on the ticks of the loop, and when it goes through the core hears
`StoreBack` and what was held is carried out, in order. Commands the core
gives meanwhile queue behind the held ones; those that only watch liveness or
log (`passes`) are carried out at once, as they commit nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from common.errors import StoreUnavailable
from common.secrets import mask_text
from common.store import OUTAGE, REFUSED, Store
from services.coordinator.store_outage import StoreBack, StoreDown

__all__ = ["RETRY_S", "Away", "Held", "once"]

C = TypeVar("C")
T = TypeVar("T")
RETRY_S = 1.0
"""Least time between two tries of the held Redis step."""


class Away(StoreUnavailable):
    """Redis did not answer a step tried `once`: the run holds the step (`Held`)."""

    def __init__(self, what: str, where: str, error: str) -> None:
        super().__init__(f"Redis at {where} unreachable while {what}: {error}")
        self.what, self.where, self.error = what, where, error


def once(store: Store, what: str, op: Callable[[], T]) -> T:
    """`op()`, the Redis step a job needs, tried once: an outage raises Away, not a wait.

    Raises:
        Away: Redis is away (the caller holds the step and tries it again later).
        StoreRefused: Redis answered but would not do it (waiting does not help).

    """
    try:
        return op()
    except REFUSED as exc:
        raise store.refusal(exc, what) from exc
    except OUTAGE as exc:
        raise Away(what, store.where, mask_text(str(exc))) from exc


class Held(Generic[C]):
    """A run's commands in order, held from the first Redis step an outage refused."""

    def __init__(
        self,
        do: Callable[[C], Sequence[C]],
        tell: Callable[[StoreDown | StoreBack], Sequence[C]],
        passes: Callable[[C], bool],
        clock: Callable[[], float] | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        """Hold what `do` cannot carry out for want of Redis; `tell` the core when and until when.

        `do(cmd)` carries one command out and returns those that must follow it at
        once (a question's answer's), raising Away when Redis is away. `tell` feeds
        the core an event and returns its commands. `passes(cmd)`: a command that
        commits nothing, carried out at once even while others are held. `clock`:
        monotonic seconds (the process's clock unless told).
        """
        self.do, self.tell, self.passes = do, tell, passes
        self.clock = time.monotonic if clock is None else clock
        self.retry_s = retry_s
        self.queue: deque[C] = deque()
        """Commands not carried out yet, the held Redis step first."""
        self.down: StoreDown | None = None
        """The outage the core was told of; None while Redis answers."""
        self._next_try = 0.0
        self._inner: list[C] | None = None
        """While a command is carried out: what its own effects gave (they follow it)."""

    @property
    def idle(self) -> bool:
        """Nothing held and nothing under way: what the core said is all carried out."""
        return not self.queue and self._inner is None

    def carry_out(self, commands: Sequence[C]) -> None:
        """Carry `commands` out in order, or queue them behind what is held."""
        if self._inner is not None:  # given while a command is carried out: right after it
            self._inner.extend(commands)
            return
        self._queue(commands)
        if self.down is None:
            self._drain()

    def tick(self) -> None:
        """Time passed: try the held Redis step again, at most once every `retry_s`."""
        if self.down is not None and self.queue and self.clock() >= self._next_try:
            self._drain()

    def _queue(self, commands: Sequence[C]) -> None:
        for cmd in commands:
            if self.down is not None and self.passes(cmd):
                self.do(cmd)
            else:
                self.queue.append(cmd)

    def _drain(self) -> None:
        """Carry out the queue from its head; stop, holding, at a step Redis does not answer."""
        while self.queue:
            cmd = self.queue[0]
            self._inner = []
            try:
                more = [*self.do(cmd), *self._inner]
            except Away as exc:
                self._next_try = self.clock() + self.retry_s
                if self.down is None:
                    self.down = StoreDown(exc.what, self.clock(), exc.where, exc.error)
                    self._inner = None
                    self._queue(self.tell(self.down))
                return
            finally:
                self._inner = None
            self.queue.popleft()
            self.queue.extendleft(reversed(more))
            if self.down is not None:  # the held step went through: Redis is back
                self.down = None
                self._queue(self.tell(StoreBack()))
