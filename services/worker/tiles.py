"""Galaxy's ring over the worker data plane: tiles out through a dispatcher, in through an inbox.

`ZmqRing` is the networked form of `services.worker.galaxy.ring.Ring` for one request:
`send` queues an `HmpTile` to the next device of the plan's ring, `recv` waits
for the previous device's tile of the same serving job, epoch, request and tag.
The receiver thread files tiles in the `TileInbox`, which takes a tile only from
the device that precedes this one in the loaded plan's ring and for the loaded
(job, epoch): anything else is dropped with the reason logged. It holds at most
`max_bytes`, and forgets a request's tiles once a later request starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from common.errors import RoundAbortedError, RoundTimeoutError
from common.ids import DeviceId
from common.serving_messages import HmpTile
from services.worker.transfers import to_device, to_host

if TYPE_CHECKING:
    from services.worker.transport import Dispatcher

__all__ = ["Expecting", "TileInbox", "ZmqRing"]

_Key = tuple[int, str]
"""A tile's request number and tag."""


@dataclass(frozen=True)
class Expecting:
    """Which tiles the inbox accepts: the loaded shard's job and epoch, from its predecessor."""

    serve_id: str
    epoch: int
    prev: DeviceId


class TileInbox:
    """Tiles delivered to this device for the loaded shard, buffered until asked for."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._tiles: dict[_Key, Tensor] = {}
        self._bytes = 0
        self._expecting: Expecting | None = None
        self._floor = 0
        """Tiles of requests below this are stale: a later request has started."""

    def expect(self, expecting: Expecting | None) -> None:
        """Accept tiles for another loaded shard (None: none); buffered tiles are dropped."""
        with self._cond:
            self._expecting = expecting
            self._tiles.clear()
            self._bytes = 0
            self._floor = 0

    def start(self, request: int) -> None:
        """A request begins: tiles of earlier ones will never be asked for."""
        with self._cond:
            self._floor = request
            for key in [k for k in self._tiles if k[0] < request]:
                self._bytes -= self._tiles.pop(key).nbytes

    def put(self, msg: HmpTile, tensor: Tensor, peer: str) -> str | None:
        """File a tile from `peer`; the reason it was dropped, or None."""
        with self._cond:
            want = self._expecting
            if want is None:
                return "no model is loaded here"
            if (msg.serve_id, msg.epoch) != (want.serve_id, want.epoch):
                return f"tile of {msg.serve_id}/{msg.epoch}, loaded {want.serve_id}/{want.epoch}"
            if peer != want.prev:
                return f"tiles come from {want.prev} in this ring, not {peer}"
            if msg.round < self._floor:
                return f"request {msg.round} is over (now {self._floor})"
            key = (msg.round, msg.tag)
            if key in self._tiles:
                return f"duplicate tile {msg.tag} of request {msg.round}"
            if self._bytes + tensor.nbytes > self.max_bytes:
                return f"inbox full ({self._bytes} of {self.max_bytes} bytes)"
            self._tiles[key] = tensor
            self._bytes += tensor.nbytes
            self._cond.notify_all()
            return None

    def take(
        self, request: int, tag: str, timeout_s: float, stopped: Callable[[], str | None]
    ) -> Tensor | None:
        """The tile (request, tag), or None after `timeout_s`; `stopped` aborts the wait."""
        deadline = time.monotonic() + timeout_s
        key = (request, tag)
        with self._cond:
            while key not in self._tiles:
                if (why := stopped()) is not None:
                    raise RoundAbortedError(why)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.1))
            tensor = self._tiles.pop(key)
            self._bytes -= tensor.nbytes
            return tensor


class ZmqRing:
    """One request's ring on the data plane; implements `services.worker.galaxy.ring.Ring`."""

    def __init__(
        self,
        devices: list[DeviceId],
        me: DeviceId,
        msg: HmpTile,
        dispatcher: Dispatcher,
        inbox: TileInbox,
        stopped: Callable[[], str | None],
        compute: torch.device | None = None,
    ) -> None:
        """`msg` is the template every tile of this request is stamped from (tag aside).

        Tiles cross the wire from host memory and are handed back on `compute`,
        the device the served blocks run on.
        """
        self._compute = compute or torch.device("cpu")
        self._devices = devices
        self._rank = devices.index(me)
        self._msg = msg
        self._dispatcher = dispatcher
        self._inbox = inbox
        self._stopped = stopped

    @property
    def rank(self) -> int:
        """Index of this device in the plan's ring."""
        return self._rank

    @property
    def world(self) -> int:
        """Devices in the plan's ring."""
        return len(self._devices)

    def _neighbour(self, step: int) -> DeviceId:
        return self._devices[(self._rank + step) % self.world]

    def send(self, tag: str, tensor: Tensor) -> None:
        """Queue `tensor` to the next device; a copy travels, so the caller may reuse its own."""
        tile = self._msg.model_copy(update={"tag": tag})
        tensor = tensor.detach()
        # off a GPU, the host copy is the copy; on a CPU, a copy of its own
        host = to_host(tensor) if tensor.device.type != "cpu" else tensor.contiguous().clone()
        self._dispatcher.send(self._neighbour(1), tile, [host])

    def recv(self, tag: str, timeout_s: float) -> Tensor:
        """The previous device's tile `tag` of this request, waiting at most `timeout_s`."""
        got = self._inbox.take(self._msg.round, tag, timeout_s, self._stopped)
        if got is None:
            raise RoundTimeoutError(
                f"{self._devices[self._rank]} expected tile {tag!r} of request "
                f"{self._msg.round} from {self._neighbour(-1)} within {timeout_s:g} s, got nothing"
            )
        return to_device(got, self._compute)
