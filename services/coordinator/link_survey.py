"""Measuring the links between a job's devices before it is planned.

Done in the shell the way profiling is: each request waits through the
coordinator's `request`, which keeps serving its socket (and honours a cancel)
meanwhile; a pair that fails or times out is left to the fallback bandwidth and
never fails the job. Runs only before a plan (a job's start, a re-plan at a round
boundary), never inside a round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from common.ids import DeviceId
from common.logging import get_logger
from common.messages import LinksMeasured, Message
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator import links
from services.coordinator.membership import Members
from services.coordinator.outcomes import JobCancelled, JobFailed

__all__ = ["LinkHost", "measure_links"]

log = get_logger(__name__)
T = TypeVar("T")


class LinkHost(Protocol):
    """What measuring links needs of the coordinator."""

    settings: CoordinatorSettings
    store: Store
    links_pending: set[tuple[DeviceId, int]]

    def link_nonce(self, device: DeviceId) -> int:
        """A fresh nonce whose answer is now awaited."""

    def request(
        self,
        service: str,
        msg: Message,
        match: Callable[[Message], bool],
        timeout_s: float,
        what: str,
    ) -> Any:
        """Send `msg` and wait for the first reply `match` accepts."""

    def durable(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, waiting out a Redis outage."""


def measure_links(coord: LinkHost, members: Members) -> dict[str, float]:
    """Measure each pair of `members` in turn, store the matrix; bytes/s by pair.

    Done in the shell the way profiling is: each request waits through
    `Coordinator.request`, which keeps pumping heartbeats (and honours a
    cancel) meanwhile; a pair that fails or times out is left to the
    fallback bandwidth, never fails the job. Runs only before a plan (a
    job's start, a re-plan at a round boundary), never inside a round.
    """
    settings = coord.settings
    rates: dict[str, float] = {}
    errors: dict[str, str] = {}
    if settings.link_probe_bytes > 0:
        for prober, target in links.pairs(members):
            got, why = _measure_pair(coord, members, prober, target)
            rates.update(got)
            errors.update(why)
    matrix = links.LinkMatrix(
        measured_at=time.time(), devices=sorted(members), links=rates, errors=errors
    )
    doc = matrix.model_dump(mode="json")
    store = coord.store
    coord.durable("storing the link matrix", lambda: store.put_json(doc, *links.LINKS_KEY))
    missing = links.unmeasured(members, rates)
    log.info("links measured", pairs=len(rates), links={k: round(v) for k, v in rates.items()})
    if missing:
        log.warning(
            "links not measured: the planner assumes the fallback bandwidth for them",
            pairs=missing,
            bandwidth=settings.link_bandwidth,
            why={k: errors.get(k, "measuring is off (link_probe_bytes 0)") for k in missing},
        )
    return rates


def _measure_pair(
    coord: LinkHost, members: Members, prober: DeviceId, target: DeviceId
) -> tuple[dict[str, float], dict[str, str]]:
    """Ask `prober` to measure its link to `target`'s sink: (rates, errors) by pair."""
    settings = coord.settings
    key = links.pair_key(prober, target)
    addr = members[target].info.link_addr
    if not addr:
        return {}, {key: f"worker {target} advertises no bandwidth sink"}
    nonce = coord.link_nonce(prober)
    req = links.request(
        nonce, target, addr, settings.link_probe_bytes, settings.link_probe_timeout_s
    )
    try:
        reply = coord.request(
            prober,
            req,
            lambda m: isinstance(m, LinksMeasured) and m.nonce == nonce,
            settings.link_probe_timeout_s + links.REPLY_SLACK_S,
            what=f"measurement of its link to {target}",
        )
    except JobCancelled:
        raise
    except JobFailed as exc:  # no answer in time: this pair falls back
        return {}, {key: str(exc)}
    finally:
        coord.links_pending.discard((prober, nonce))
    return links.answer(req, reply)
