"""Lightweight re-planning after devices are lost (Asteroid §3.4 (3)), as pure functions.

Instead of profiling and planning again, the current plan is adjusted: lost
devices leave their groups, a stage whose whole group is gone disappears, and
the partition points move so that each remaining group's share of the layers'
cost follows its capacity (the sum of its devices' speeds). The groups keep
their order, so most layers stay where they are. Costs and speeds come from
profiles when the job has them, else every layer and device counts alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.errors import AsteroidError
from common.ids import DeviceId
from common.plan import Plan, StageSpec
from common.profile import ClusterSpec, Profile

__all__ = ["RecoveryImpossible", "capacities", "partition", "survivors_plan"]


class RecoveryImpossible(AsteroidError):
    """No plan on the surviving devices can continue the job; the message says why."""


def partition(costs: Sequence[float], capacity: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per group in order, minimising the slowest group's time.

    A group's time is the cost of its layers divided by its capacity; every
    group gets at least one layer. Exact dynamic programme over split points
    (layers and groups are few), ties to the earlier split so every run agrees.
    """
    n, s = len(costs), len(capacity)
    if s == 0:
        raise RecoveryImpossible("no device group survives")
    if n < s:
        raise RecoveryImpossible(f"{s} groups survive but the model has only {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[g][i]: the least slowest-group time covering layers [0, i) with groups [0, g)
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    cut = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for g in range(1, s + 1):
        for i in range(g, n - (s - g) + 1):
            for j in range(g - 1, i):
                t = max(best[g - 1][j], (prefix[i] - prefix[j]) / capacity[g - 1])
                if t < best[g][i]:
                    best[g][i], cut[g][i] = t, j
    ranges: list[tuple[int, int]] = []
    i = n
    for g in range(s, 0, -1):
        j = cut[g][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def survivors_plan(
    plan: Plan,
    lost: set[DeviceId],
    layer_costs: Sequence[float] | None = None,
    speeds: Mapping[DeviceId, float] | None = None,
) -> Plan:
    """`plan` without the `lost` devices, its partition points moved by capacity.

    Raises:
        RecoveryImpossible: No device survives, or fewer layers than groups.

    """
    groups = [[a for a in stage.devices if a.device not in lost] for stage in plan.stages]
    groups = [g for g in groups if g]
    layers = plan.stages[-1].end
    costs = list(layer_costs) if layer_costs is not None else [1.0] * layers
    if len(costs) != layers:
        raise RecoveryImpossible(f"{len(costs)} layer costs for a model of {layers} layers")
    speed = speeds or {}
    capacity = [sum(speed.get(a.device, 1.0) for a in g) for g in groups]
    ranges = partition(costs, capacity)
    stages = [
        StageSpec(start=lo, end=hi, devices=g) for (lo, hi), g in zip(ranges, groups, strict=True)
    ]
    return plan.model_copy(
        update={
            "stages": stages,
            "planner": f"{plan.planner}+lightweight",
            "predicted_round_s": None,
            "predicted_peak_bytes": {},
        }
    )


def capacities(
    cluster: ClusterSpec, profiles: Mapping[str, Profile], batch: int
) -> tuple[list[float], dict[DeviceId, float]]:
    """Per-layer costs and per-device speeds from the job's profiles (Asteroid's inputs).

    A layer's cost is its forward plus backward time at the batch size nearest
    `batch`, averaged over the profiled devices; a device's speed is the inverse
    of its whole model's time (times its slowdown).
    """
    totals: dict[DeviceId, float] = {}
    per_layer: list[list[float]] = []
    for device in cluster.devices:
        profile = profiles.get(device.profile)
        if profile is None:
            continue
        at = min(range(len(profile.batch_sizes)), key=lambda k: abs(profile.batch_sizes[k] - batch))
        times = [
            (layer.forward_s[at] + layer.backward_s[at]) * device.slowdown
            for layer in profile.layers
        ]
        per_layer.append(times)
        totals[DeviceId(device.name)] = sum(times)
    if not per_layer:
        raise RecoveryImpossible("the job's devices have no profiles to weigh layers by")
    costs = [sum(col) / len(col) for col in zip(*per_layer, strict=True)]
    return costs, {d: 1.0 / t for d, t in totals.items() if t > 0}
