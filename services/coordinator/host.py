"""What a job's shell may use of the coordinator, as a protocol.

Training, serving and federated runs (`jobs`, `job_effects`, `serving`,
`federated`) take a `Host` rather than the `Coordinator` class, so none of them
imports the service module that runs them: the service depends on its runs,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from common.ids import DeviceId
from common.messages import Message
from common.profile import ClusterSpec
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.checks import CheckedJob
from services.coordinator.core import Heard, Log, SendProbe
from services.coordinator.fair_queue import FairQueue
from services.coordinator.in_force import InForce
from services.coordinator.membership import Members

__all__ = ["Host"]

T = TypeVar("T")


class Host(Protocol):
    """The coordinator's state and I/O a run reads, sets and calls."""

    settings: CoordinatorSettings
    endpoint: str
    store: Store
    members: Members
    assigned: frozenset[DeviceId]
    running: str | None
    federated: str | None
    collecting: bool
    cancelled: dict[str, str]
    drains: dict[DeviceId, str]
    links_pending: set[tuple[DeviceId, int]]
    infer_queue: FairQueue[Any]
    services: dict[str, float]
    """Services heard from, and when they last said hello (monotonic seconds)."""
    timeouts: InForce
    """The detection timeouts in force (a job's limits and its Assigns follow them)."""

    def send(self, device: DeviceId, msg: Message) -> None:
        """Send a control message to a peer."""

    def durable(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, waiting out a Redis outage."""

    def write_soon(self, what: str, op: Callable[[], object]) -> None:
        """`op()` now, or once Redis is back."""

    def write_state(self, jid: str, state: str, **extra: Any) -> None:
        """Write a job's state."""

    def register(self, checked: CheckedJob, forget_old: bool = False) -> None:
        """Record a job as submitted."""

    def alive(self) -> Members:
        """Workers whose heartbeats are current."""

    def cluster_base(self) -> ClusterSpec | None:
        """The cluster spec file, if any."""

    def link_nonce(self, device: DeviceId) -> int:
        """A fresh nonce for a link measurement."""

    def carry_out(self, cmd: SendProbe | Heard | Log) -> None:
        """Do what a wait's core asked."""
