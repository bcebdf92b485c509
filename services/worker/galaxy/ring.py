"""The ring a Galaxy device talks through: send to the next device, receive from the previous.

Ring AllGather and ReduceScatter (Galaxy §III-D) only ever talk to the two ring
neighbours, so the transport is just that: a queued, non-blocking `send` to
device `rank + 1` and a `recv` from device `rank - 1` with an explicit timeout.
Messages carry a tag (collective, layer, step) so that arrival order does not
matter: a receiver buffers by tag. `local_rings` is the in-process form for tests
and single-host runs; a networked form implements the same `Ring` protocol.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Protocol, runtime_checkable

from torch import Tensor

from common.errors import ConfigError, RoundTimeoutError

__all__ = ["LocalRing", "Ring", "local_rings"]


@runtime_checkable
class Ring(Protocol):
    """One device's view of the ring: its place, its successor and its predecessor."""

    @property
    def rank(self) -> int:
        """Index of the device in the ring, `0 <= rank < world`."""
        ...

    @property
    def world(self) -> int:
        """How many devices the ring has."""
        ...

    def send(self, tag: str, tensor: Tensor) -> None:
        """Queue `tensor` for device `(rank + 1) % world` under `tag`; does not wait."""
        ...

    def recv(self, tag: str, timeout_s: float) -> Tensor:
        """The tensor device `(rank - 1) % world` sent under `tag`.

        Raises:
            RoundTimeoutError: If nothing with that tag arrives within `timeout_s`;
                the message names the peer and the tag.

        """
        ...


class _Mailbox:
    """Tensors delivered to one device, buffered per tag until it asks for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_tag: defaultdict[str, deque[Tensor]] = defaultdict(deque)

    def put(self, tag: str, tensor: Tensor) -> None:
        with self._cond:
            self._by_tag[tag].append(tensor)
            self._cond.notify_all()

    def take(self, tag: str, timeout_s: float) -> Tensor | None:
        """The oldest tensor under `tag`, or None once `timeout_s` has passed without one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._by_tag.get(tag):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            queue = self._by_tag[tag]
            tensor = queue.popleft()
            if not queue:
                del self._by_tag[tag]
            return tensor


class LocalRing:
    """An in-process ring member: sending puts a copy into the successor's mailbox.

    The copy stands in for the wire, so a sender that later changes its tensor in
    place cannot change what the receiver got.
    """

    def __init__(self, rank: int, mailboxes: list[_Mailbox], names: list[str]) -> None:
        self._rank = rank
        self._boxes = mailboxes
        self._names = names

    @property
    def rank(self) -> int:
        """Index of the device in the ring."""
        return self._rank

    @property
    def world(self) -> int:
        """How many devices the ring has."""
        return len(self._boxes)

    def send(self, tag: str, tensor: Tensor) -> None:
        """Deliver a copy of `tensor` to the successor's mailbox under `tag`."""
        self._boxes[(self._rank + 1) % self.world].put(tag, tensor.detach().clone())

    def recv(self, tag: str, timeout_s: float) -> Tensor:
        """Wait up to `timeout_s` for the predecessor's tensor under `tag`.

        Raises:
            RoundTimeoutError: If it does not come in time; names the peer and the tag.

        """
        got = self._boxes[self._rank].take(tag, timeout_s)
        if got is None:
            prev = (self._rank - 1) % self.world
            raise RoundTimeoutError(
                f"{self._names[self._rank]} expected {tag!r} from {self._names[prev]} "
                f"within {timeout_s:g} s, got nothing"
            )
        return got


def local_rings(world: int, names: list[str] | None = None) -> list[LocalRing]:
    """`world` connected in-process ring members, one per device thread.

    Args:
        world: Number of devices.
        names: How errors name each device; "device 0", "device 1", ... by default.

    Raises:
        ConfigError: If `world < 1` or `names` does not have one entry per device.

    """
    if world < 1:
        raise ConfigError(f"a ring needs at least 1 device, got {world}")
    labels = names if names is not None else [f"device {i}" for i in range(world)]
    if len(labels) != world:
        raise ConfigError(f"expected {world} device names, got {len(labels)}")
    boxes = [_Mailbox() for _ in range(world)]
    return [LocalRing(i, boxes, labels) for i in range(world)]
