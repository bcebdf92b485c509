"""A waiting line shared fairly between requesters: one FIFO per owner, served in turn.

With one FIFO for everyone, a peer that queues 100 inference requests makes
the next peer wait for all of them (122 s in a probe); here each owner (a key,
or a claimed name without keys) may hold at most `per_owner` places of the
`total`, and `take` serves owners round-robin, so a newcomer waits for at most
one request of each other owner. Pure: no clock, no sockets.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


@dataclass
class FairQueue(Generic[T]):
    """Items waiting per owner; `take` serves the owners in turn, each in arrival order."""

    per_owner: int
    total: int
    _lines: OrderedDict[str, deque[T]] = field(default_factory=OrderedDict)
    _size: int = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        """Every waiting item, owner by owner (for inspection; `take` decides the order)."""
        for line in self._lines.values():
            yield from line

    def copied(self) -> FairQueue[T]:
        """A copy that changes apart from this one (the items themselves are shared)."""
        lines = OrderedDict((owner, deque(line)) for owner, line in self._lines.items())
        return FairQueue(self.per_owner, self.total, lines, self._size)

    def offer(self, owner: str, item: T) -> str | None:
        """Queue `item` for `owner`; or the reason it cannot wait (nothing is queued)."""
        line = self._lines.get(owner)
        if line is not None and len(line) >= self.per_owner:
            return f"{self.per_owner} requests of {owner} already wait; try again later"
        if self._size >= self.total:
            return f"{self.total} requests already wait; try again later"
        if line is None:
            line = self._lines[owner] = deque()
        line.append(item)
        self._size += 1
        return None

    def take(self) -> T | None:
        """The oldest item of the owner whose turn it is (that owner goes last); None if empty."""
        if not self._lines:
            return None
        owner, line = next(iter(self._lines.items()))
        item = line.popleft()
        self._size -= 1
        if line:
            self._lines.move_to_end(owner)
        else:
            del self._lines[owner]
        return item

    def drop(self, expired: Callable[[T], bool]) -> list[T]:
        """Remove and return every item for which `expired` is true."""
        gone: list[T] = []
        for owner, line in list(self._lines.items()):
            keep: deque[T] = deque()
            for item in line:
                (gone if expired(item) else keep).append(item)
            if keep:
                self._lines[owner] = keep
            else:
                del self._lines[owner]
        self._size -= len(gone)
        return gone
