"""What a job's shell may use of the coordinator, as a protocol.

Training, serving and federated runs (`jobs`, `serving`, `federated`,
`profiling`) take a `Host` rather than the `Coordinator` class, so none of them
imports the service module that runs them: the service depends on its runs,
never the other way round.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from common.ids import DeviceId
from common.messages import Message, PlanRequest
from common.plan import Plan
from common.profile import ClusterSpec
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.checks import CheckedJob
from services.coordinator.core import Event, Heard, Log, SendProbe
from services.coordinator.fair_queue import FairQueue
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
    inbox: deque[tuple[DeviceId, Message]]
    cancelled: dict[str, str]
    drains: dict[DeviceId, str]
    links_pending: set[tuple[DeviceId, int]]
    infer_queue: FairQueue[Any]
    services: dict[str, float]
    """Services heard from, and when they last said hello (monotonic seconds)."""

    def send(self, device: DeviceId, msg: Message) -> None:
        """Send a control message to a peer."""

    def pump(self, timeout_s: float) -> None:
        """Serve the socket for up to `timeout_s`."""

    def durable(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, waiting out a Redis outage."""

    def write_soon(self, what: str, op: Callable[[], object]) -> None:
        """`op()` now, or once Redis is back."""

    def write_state(self, jid: str, state: str, **extra: Any) -> None:
        """Write a job's state."""

    def register(self, checked: CheckedJob, forget_old: bool = False) -> None:
        """Record a job as submitted."""

    def check_cancelled(self, jid: str) -> None:
        """Raise JobCancelled if someone cancelled job `jid`."""

    def alive(self) -> Members:
        """Workers whose heartbeats are current."""

    def wait_for_devices(self, devices: list[DeviceId], timeout_s: float) -> None:
        """Block until every device has sent a heartbeat."""

    def cluster_base(self) -> ClusterSpec | None:
        """The cluster spec file, if any."""

    def profilers(self, timeout_s: float) -> list[str]:
        """Profiler services heard from recently."""

    def link_nonce(self, device: DeviceId) -> int:
        """A fresh nonce for a link measurement."""

    def request(
        self,
        service: str,
        msg: Message,
        match: Callable[[Message], bool],
        timeout_s: float,
        what: str,
    ) -> Any:
        """Send `msg` and wait for the first reply `match` accepts."""

    def request_scored_plan(self, req: PlanRequest, timeout_s: float) -> tuple[Plan, float]:
        """The planner's plan, and its prediction of `req.current`."""

    def events(self, poll_s: float = 0.05) -> Iterator[Event]:
        """What happened since the last look, as events."""

    def carry_out(self, cmd: SendProbe | Heard | Log) -> None:
        """Do what a wait's core asked."""

    def gather(
        self,
        kind: type[Message],
        devices: list[DeviceId],
        epoch: int,
        round_no: int,
        timeout_s: float,
        watchdog_s: float | None = None,
    ) -> dict[DeviceId, Any]:
        """Wait for one `kind` reply of (epoch, round) from each of `devices`."""
