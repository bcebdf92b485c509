"""Asteroid's Algorithm 1: split a stage's micro-batch among its device group.

Inside a stage every device runs the same layer range on its own samples, so
the stage's step lasts as long as its slowest member. The split starts
proportional to each device's speed on that range, is then bent to the memory
budgets (a device that cannot keep its share's activations for K_p
micro-batches hands samples to the others), and finally straggler offloading
moves samples one at a time from the slowest device to the one that would
finish earliest, while that lowers the step. Time is not linear in batch size,
which is why the last, measured, phase is needed at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.plan import Plan
from services.planner.cost import CostModel

__all__ = ["Balanced", "balance", "capacity", "fit_backups", "proportional"]


@dataclass(frozen=True, slots=True)
class Balanced:
    """Samples of each micro-batch per device (in group order) and the step seconds."""

    counts: tuple[int, ...]
    time: float


def capacity(
    cost: CostModel, device: str, start: int, end: int, in_flight: int, reserved: int = 0
) -> int:
    """Most samples per micro-batch `device` can hold for layers [start, end) (may be 0).

    Memory is linear in the share (`CostModel.memory`): states plus
    per-sample activations times the `in_flight` micro-batches kept for backward.
    `reserved` bytes of the budget are taken already (replicas the device backs up).
    """
    budget = cost.cluster.device(device).memory_bytes - reserved
    states = cost.memory(start, end, 0, in_flight)
    per_sample = cost.memory(start, end, 1, in_flight) - states
    if states > budget:
        return 0
    if per_sample == 0:
        return 1 << 62
    return (budget - states) // per_sample


def balance(
    cost: CostModel,
    devices: Sequence[str],
    start: int,
    end: int,
    micro: int,
    in_flight: int,
    *,
    memory: bool = True,
    free: Balanced | None = None,
    reserved: Mapping[str, int] | None = None,
) -> Balanced | None:
    """Shares of a `micro`-sample micro-batch for `devices` on layers [start, end).

    Every device gets at least one sample. The split balanced for speed alone
    is kept when it fits (planners pass it as `free` when they already have
    it: it does not depend on `in_flight`); otherwise the over-budget shares
    are cut and the split rebalanced under the caps. Returns None when the
    group cannot run the range: more devices than samples, or (with
    `memory`) a member that cannot hold the range even with one sample, or
    budgets that together hold fewer than `micro` samples. `reserved` takes
    replica bytes off the budgets of the devices that back up other stages.
    """
    n = len(devices)
    if n > micro:
        return None
    limit = micro - n + 1
    if free is None:
        free = _split(cost, devices, start, end, micro, [limit] * n)
    if not memory:
        return free
    held = reserved or {}
    caps = [min(limit, capacity(cost, d, start, end, in_flight, held.get(d, 0))) for d in devices]
    if all(c <= cap for c, cap in zip(free.counts, caps, strict=True)):
        return free
    if min(caps) < 1 or sum(caps) < micro:
        return None
    return _split(cost, devices, start, end, micro, caps)


def fit_backups(cost: CostModel, plan: Plan) -> Plan | None:
    """`plan` with the splits of replica-holding groups refitted to what is left, or None.

    A backup node holds a neighbouring stage's replica, which the planners'
    search does not see when it splits a group; who backs up whom depends only
    on the groups and ranges, though, so once the plan is whole a group whose
    split overflows beside its replicas is split again within what they leave
    of the budgets (a split that fits is kept). None when such a group cannot
    hold its range beside the replicas at all.
    """
    reserved = cost.reserved(plan)
    stages = list(plan.stages)
    for p, spec in enumerate(plan.stages):
        k = plan.warmup(p)
        counts = [hi - lo for lo, hi in plan.ranges(p).values()]
        devs = [a.device for a in spec.devices]
        caps = [capacity(cost, d, spec.start, spec.end, k, reserved[d]) for d in devs]
        if all(n <= c for n, c in zip(counts, caps, strict=True)):
            continue
        got = balance(cost, devs, spec.start, spec.end, plan.micro_size, k, reserved=reserved)
        if got is None:
            return None
        allocs = [
            a.model_copy(update={"share": n}) for a, n in zip(spec.devices, got.counts, strict=True)
        ]
        stages[p] = spec.model_copy(update={"devices": allocs})
    return plan.model_copy(update={"stages": stages})


def _split(
    cost: CostModel, devices: Sequence[str], start: int, end: int, micro: int, caps: list[int]
) -> Balanced:
    """The three phases under per-device caps that together hold `micro` samples."""
    n = len(devices)

    def t(i: int, samples: int) -> float:
        return cost.step(devices[i], start, end, samples)

    if n == 1:
        return Balanced((micro,), t(0, micro))
    counts = proportional(cost, devices, start, end, micro)

    # Memory: cut over-budget shares, giving each sample to whoever finishes first.
    for i in range(n):
        while counts[i] > caps[i]:
            j = min((j for j in range(n) if counts[j] < caps[j]), key=lambda j: t(j, counts[j] + 1))
            counts[i] -= 1
            counts[j] += 1

    # Straggler offloading: move one sample from the slowest device to the one
    # that would finish earliest with it, while the step gets shorter.
    times = [t(i, counts[i]) for i in range(n)]
    while True:
        slow = max(range(n), key=times.__getitem__)
        if counts[slow] <= 1:
            break
        takers = [j for j in range(n) if j != slow and counts[j] < caps[j]]
        if not takers:
            break
        best = min(takers, key=lambda j: t(j, counts[j] + 1))
        new_slow, new_best = t(slow, counts[slow] - 1), t(best, counts[best] + 1)
        rest = max((times[k] for k in range(n) if k not in (slow, best)), default=0.0)
        if max(new_slow, new_best, rest) >= times[slow]:
            break
        counts[slow] -= 1
        counts[best] += 1
        times[slow], times[best] = new_slow, new_best
    return Balanced(tuple(counts), max(times))


def proportional(
    cost: CostModel, devices: Sequence[str], start: int, end: int, micro: int
) -> list[int]:
    """Integer shares proportional to speed on the range, each at least one sample.

    Speed is measured at an even share, the batch size each device would run
    without balancing; largest remainders round, ties to the earlier device.
    """
    n = len(devices)
    even = max(1, round(micro / n))
    per_sample = [cost.step(d, start, end, even) / even for d in devices]
    if min(per_sample) <= 0.0:
        rates = [1.0 if p <= 0.0 else 0.0 for p in per_sample]  # free devices share
    else:
        rates = [1.0 / p for p in per_sample]
    weight = sum(rates)
    spare = micro - n
    exact = [spare * r / weight for r in rates]
    counts = [int(e) for e in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: spare - sum(counts)]:
        counts[i] += 1
    return [c + 1 for c in counts]
