"""Inference requests waiting for the running serving job: who asked, what, since when.

The queue is fair between requesters (`FairQueue`): one requester cannot fill it
and starve the others, and a request leaves it once its `wait_s` has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.ids import DeviceId
from common.serving_messages import InferRequest
from services.coordinator.fair_queue import FairQueue

__all__ = ["MAX_QUEUED", "MAX_QUEUED_PER_OWNER", "PendingRequest", "infer_queue"]

MAX_QUEUED = 64
"""Requests that may wait while one runs; beyond, a request is refused at once."""
MAX_QUEUED_PER_OWNER = 16
"""Of those, what one requester (a key; a claimed name without keys) may hold."""


@dataclass(frozen=True)
class PendingRequest:
    """A request waiting for its turn: who asked, what, and since when."""

    peer: DeviceId
    msg: InferRequest
    arrived: float

    @property
    def owner(self) -> str:
        """Who the request counts against: the key's name, whatever session it came on."""
        return self.peer.partition("/")[0]

    def expired(self, now: float) -> bool:
        """Whether the requester has stopped waiting for it (its `wait_s` has passed)."""
        return now - self.arrived > self.msg.wait_s


def infer_queue() -> FairQueue[PendingRequest]:
    """The queue of a coordinator's inference requests: fair between requesters."""
    return FairQueue(per_owner=MAX_QUEUED_PER_OWNER, total=MAX_QUEUED)
