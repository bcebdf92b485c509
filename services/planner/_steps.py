"""Pipeline steps of a partial plan: stage compute, boundary communication, all-reduce.

The planners' search loops build plans stage by stage, so they score them from
plain tuples with these pieces instead of building a `Plan` per candidate. The
pieces are exactly those of `simulator.estimate` (Asteroid's dominant-step
model), so a plan assembled from them gets the same figure from it:

    round = sum(steps) + (M - 1) * max(steps) + max(stage all-reduces)
"""

from __future__ import annotations

from collections.abc import Sequence

from services.planner.cost import CostModel


def stage_time(
    cost: CostModel, devices: Sequence[str], counts: Sequence[int], start: int, end: int
) -> float:
    """Forward plus backward seconds of one micro-batch: the slowest member's share."""
    return max(cost.step(d, start, end, n) for d, n in zip(devices, counts, strict=True))


def comm_time(
    cost: CostModel,
    boundary: int,
    senders: Sequence[str],
    sent: Sequence[int],
    receivers: Sequence[str],
    received: Sequence[int],
) -> float:
    """Seconds of the boundary step: the slowest route's activations plus gradients.

    Samples are routed by range, as `common.plan.routes` does; `boundary` is the
    first layer of the receiving stage.
    """
    worst = 0.0
    s_lo = 0
    for src, ns in zip(senders, sent, strict=True):
        r_lo = 0
        for dst, nr in zip(receivers, received, strict=True):
            n = min(s_lo + ns, r_lo + nr) - max(s_lo, r_lo)
            if n > 0:
                nbytes = cost.boundary_bytes(boundary, n)
                t = cost.transfer(src, dst, nbytes) + cost.transfer(dst, src, nbytes)
                worst = max(worst, t)
            r_lo += nr
        s_lo += ns
    return worst


def total(steps_sum: float, steps_max: float, reduce_max: float, microbatches: int) -> float:
    """The dominant-step round latency from its three aggregates."""
    return steps_sum + (microbatches - 1) * steps_max + reduce_max
