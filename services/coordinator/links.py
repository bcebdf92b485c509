"""The link matrix: which pairs to measure, how, and what a measurement's answer means.

Before a job is planned (at its start, and at every re-plan: a device joining,
a recovery), the coordinator measures the bandwidth of each unordered pair of
the job's workers once, one pair after another (pairs share the network, so
measuring them at once would measure the contention). The smaller name of a
pair probes the other's bandwidth sink. The matrix is stored in Redis under
``links`` with when it was measured, and becomes the planner's `ClusterSpec.links`;
a pair that could not be measured gets the configured bandwidth, and says why.

These are the pure parts; the shell (`jobs.JobRun`) sends the requests and waits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from common.ids import DeviceId
from common.messages import MAX_LINK_MESSAGE_BYTES, LinksMeasured, MeasureLinks

__all__ = [
    "LINKS_KEY",
    "PROBE_MESSAGE_BYTES",
    "REPLY_SLACK_S",
    "LinkMatrix",
    "answer",
    "pair_key",
    "pairs",
    "request",
    "unmeasured",
]

LINKS_KEY = ("links",)
"""Where the newest matrix is stored, under the cluster's prefix."""
PROBE_MESSAGE_BYTES = 1 << 20
"""Payload of one probe message: big enough that per-message costs do not dominate."""
REPLY_SLACK_S = 2.0
"""Time the coordinator allows beyond a probe's own timeout for its answer to arrive."""


class LinkMatrix(BaseModel):
    """Measured bandwidth between a set of devices, as stored in Redis."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measured_at: float = Field(description="Wall-clock time (s since the epoch) it was measured.")
    devices: list[str]
    links: dict[str, float] = Field(
        default_factory=dict, description='Bytes/s per measured pair, key "a|b" with a < b.'
    )
    errors: dict[str, str] = Field(
        default_factory=dict, description="Why each pair that was not measured was not."
    )


def pair_key(a: str, b: str) -> str:
    """The key of the unordered pair {a, b}, as `ClusterSpec.links` reads it."""
    lo, hi = sorted((a, b))
    return f"{lo}|{hi}"


def pairs(devices: Iterable[DeviceId]) -> list[tuple[DeviceId, DeviceId]]:
    """Each unordered pair once, in a fixed order: (prober, sink) with prober < sink."""
    return list(itertools.combinations(sorted(set(devices)), 2))


def request(
    nonce: int, target: DeviceId, addr: str, total_bytes: int, timeout_s: float
) -> MeasureLinks:
    """The MeasureLinks that streams about `total_bytes` to `target`'s sink at `addr`."""
    nbytes = max(1, min(total_bytes, PROBE_MESSAGE_BYTES, MAX_LINK_MESSAGE_BYTES))
    count = max(1, math.ceil(total_bytes / nbytes))
    return MeasureLinks(
        nonce=nonce, targets={target: addr}, nbytes=nbytes, count=count, timeout_s=timeout_s
    )


def answer(req: MeasureLinks, reply: LinksMeasured) -> tuple[dict[str, float], dict[str, str]]:
    """The rates and errors `reply` gives for `req`'s targets, keyed by pair.

    A reply must account for exactly the targets asked, each once: one that
    names other devices, or leaves one out, is not trusted for any of them.
    """
    asked = set(req.targets)
    named = set(reply.rates) | set(reply.errors)
    if named != asked or set(reply.rates) & set(reply.errors):
        why = (
            f"{reply.device} answered for {sorted(named)[:8]} "
            f"(rates and errors), asked for {sorted(asked)}"
        )
        return {}, {pair_key(reply.device, t): why for t in asked}
    rates = {pair_key(reply.device, t): r for t, r in reply.rates.items()}
    errors = {pair_key(reply.device, t): e for t, e in reply.errors.items()}
    return rates, errors


def unmeasured(devices: Iterable[DeviceId], links: Mapping[str, float]) -> list[str]:
    """The pairs of `devices` that `links` has no measurement of."""
    return [pair_key(a, b) for a, b in pairs(devices) if pair_key(a, b) not in links]
