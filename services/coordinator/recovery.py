"""Lightweight re-planning after devices are lost (Asteroid §3.4 (3)), as pure functions.

Instead of profiling and planning again, the current plan is adjusted: lost
devices leave their groups, a stage whose whole group is gone disappears, and
the partition points move so that each remaining group's share of the layers'
cost follows its capacity (the sum of its devices' speeds). The groups keep
their order, so most layers stay where they are. Costs and speeds come from
profiles when the job has them, else every layer and device counts alike.
With per-layer byte counts and the survivors' budgets, only splits that every
device can hold are considered; when none can, recovery fails naming the
layers that do not fit, rather than training on with a stage nobody holds.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from common.errors import AsteroidError
from common.ids import DeviceId
from common.memory_model import LayerMemory
from common.plan import Allocation, Plan, StageSpec
from common.profile import ClusterSpec, Profile

__all__ = [
    "MemoryInputs",
    "RecoveryImpossible",
    "capacities",
    "memory_inputs",
    "partition",
    "survivors_plan",
]

Fits = Callable[[int, int, int], bool]
"""`fits(group, start, end)`: whether group `group` (0-based) can hold layers [start, end)."""


class RecoveryImpossible(AsteroidError):
    """No plan on the surviving devices can continue the job; the message says why."""


@dataclass(frozen=True)
class MemoryInputs:
    """What a memory check of the survivors needs: the model's bytes and each device's budget.

    A budget of 0, or a device without one, is unknown and counts as unlimited:
    refusing to recover on a guess would stop jobs that fit.
    """

    layers: LayerMemory
    budgets: Mapping[DeviceId, int] = field(default_factory=dict)


def _check_shape(n: int, s: int) -> None:
    """Every group needs a layer of its own."""
    if s == 0:
        raise RecoveryImpossible("no device group survives")
    if n < s:
        raise RecoveryImpossible(f"{s} groups survive but the model has only {n} layers")


def _minimax(
    n: int, s: int, cost: Callable[[int, int, int], float]
) -> tuple[float, list[tuple[int, int]]]:
    """The split of `n` layers into `s` contiguous ranges minimising the largest `cost`.

    `cost(g, j, i)` prices group g (0-based) holding layers [j, i); an infinite
    cost forbids that range. Returns the optimum and its ranges, or (inf, [])
    when every split is forbidden. Exact dynamic programme over split points
    (layers and groups are few), ties to the earlier split so every run agrees.
    """
    inf = float("inf")
    # best[g][i]: the least largest cost covering layers [0, i) with groups [0, g)
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    cut = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for g in range(1, s + 1):
        for i in range(g, n - (s - g) + 1):
            for j in range(g - 1, i):
                if best[g - 1][j] == inf:
                    continue
                t = max(best[g - 1][j], cost(g - 1, j, i))
                if t < best[g][i]:
                    best[g][i], cut[g][i] = t, j
    if best[s][n] == inf:
        return inf, []
    ranges: list[tuple[int, int]] = []
    i = n
    for g in range(s, 0, -1):
        j = cut[g][i]
        ranges.append((j, i))
        i = j
    return best[s][n], ranges[::-1]


def partition(
    costs: Sequence[float], capacity: Sequence[float], fits: Fits | None = None
) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per group in order, minimising the slowest group's time.

    A group's time is the cost of its layers divided by its capacity; every
    group gets at least one layer. With `fits`, a range a group cannot hold is
    never chosen, however fast it would be.

    Raises:
        RecoveryImpossible: No group survives, fewer layers than groups, or no
            split passes `fits`.

    """
    n, s = len(costs), len(capacity)
    _check_shape(n, s)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")

    def time(g: int, j: int, i: int) -> float:
        if fits is not None and not fits(g, j, i):
            return inf
        return (prefix[i] - prefix[j]) / capacity[g]

    _, ranges = _minimax(n, s, time)
    if not ranges:
        raise RecoveryImpossible(f"no split of {n} layers over {s} groups fits their memory")
    return ranges


Range = tuple[int, int]


class _StageMemory:
    """Each surviving device's peak for a layer range, in the re-planned pipeline's shape.

    A device's samples are its share of a micro-batch and its stage's K_p is
    that of the new plan (fewer stages, so fewer forwards in flight upstream),
    exactly as the planner would predict for the same plan. A group's first
    device also holds the replica of the group before it (the last group's
    lands on the first) when that group is a single device (`Plan.backup_of`),
    so a group's peak can depend on its neighbour's range as well as its own.
    """

    def __init__(self, plan: Plan, groups: list[list[Allocation]], memory: MemoryInputs) -> None:
        shape = plan.model_copy(
            update={
                "stages": [
                    StageSpec(start=g, end=g + 1, devices=devs) for g, devs in enumerate(groups)
                ]
            }
        )
        self.layers = memory.layers
        self.members: list[list[tuple[DeviceId, int, int]]] = []
        self.in_flight: list[int] = []
        # backs_up[g]: group g's first device holds the replica of group g - 1 (cyclically);
        # by the rule a device backs up at most its predecessor, the one dependence kept here
        self.backs_up: list[bool] = []
        for g in range(len(groups)):
            self.in_flight.append(shape.warmup(g))
            self.members.append(
                [(d, hi - lo, memory.budgets.get(d, 0)) for d, (lo, hi) in shape.ranges(g).items()]
            )
            held = shape.backups_held(groups[g][0].device)
            self.backs_up.append(bool(held))
        self._short: dict[tuple[int, Range, Range | None], int] = {}

    @property
    def linked(self) -> bool:
        """Whether some group's peak depends on its neighbour's range (it holds a replica)."""
        return any(self.backs_up)

    def needs(
        self, g: int, start: int, end: int, prev: Range | None = None
    ) -> list[tuple[DeviceId, int, int]]:
        """(device, budget, bytes needed) of every device of group `g` holding [start, end).

        `prev` is the range of the group before `g` (the last group's for the
        first): its replica counts on `g`'s first device when that one backs it up.
        """
        k = self.in_flight[g]
        out = [(d, b, self.layers.stage(start, end, n, k)) for d, n, b in self.members[g]]
        if prev is not None and self.backs_up[g]:
            d, b, need = out[0]
            out[0] = (d, b, need + self.layers.replica(*prev))
        return out

    def shortfall(self, g: int, start: int, end: int, prev: Range | None = None) -> int:
        """Bytes the most overcommitted device of group `g` lacks for [start, end) (0: fits)."""
        key = (g, (start, end), prev if self.backs_up[g] else None)
        if key not in self._short:
            over = (need - b for _, b, need in self.needs(g, start, end, prev) if b > 0)
            self._short[key] = max([0, *over])
        return self._short[key]

    def fits(self, g: int, start: int, end: int) -> bool:
        """Whether every device of group `g` holds layers [start, end) within its budget."""
        return self.shortfall(g, start, end) == 0

    def split(self, n: int, time: Callable[[int, int, int], float]) -> list[Range]:
        """The split of `n` layers minimising the slowest `time` where every device fits.

        Replicas included. The answer is one group's time on one range, so a
        bisection over those values with `_feasible` finds it exactly.
        """
        s = len(self.members)
        times = sorted(
            {time(g, i, k) for g in range(s) for i in range(n) for k in range(i + 1, n + 1)}
        )
        best: list[Range] | None = None
        lo, hi = 0, len(times) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            got = self._feasible(n, 0, self._within(time, times[mid]))
            if got is None:
                lo = mid + 1
            else:
                best, hi = got, mid - 1
        if best is None:
            raise RecoveryImpossible(f"no split of {n} layers over {s} groups fits their memory")
        return best

    @staticmethod
    def _within(time: Callable[[int, int, int], float], most: float) -> Fits:
        """Whether a group's range takes at most `most` by `time`."""

        def fast_enough(g: int, i: int, k: int) -> bool:
            return time(g, i, k) <= most

        return fast_enough

    def _own_short(self, g: int, i: int, k: int) -> int:
        """Bytes group `g`'s worst device lacks for [i, k), not counting any replica."""
        return self.shortfall(g, i, k)

    def _room(self, g: int, i: int, k: int, slack: int) -> float:
        """Replica bytes group `g`'s first device can take beside [i, k) (inf: no budget)."""
        _, b, need = self.needs(g, i, k)[0]
        return math.inf if b <= 0 else b + slack - need

    def _feasible(self, n: int, slack: int, allowed: Fits) -> list[Range] | None:
        """A split where no device lacks more than `slack` bytes and `allowed` holds, or None.

        A dynamic programme over the last group's range: a group's replica ties
        its first device to the range before it, and since a shorter range has
        a smaller replica, the ranges before that fit are those starting late
        enough (a suffix). When the first group backs up the last, each state
        also keeps the least end of the first group that reaches it: a shorter
        first range only leaves more room for the last group's replica.
        O(s n^2 log n).
        """
        s = len(self.members)
        ring = self.backs_up[0] and s > 1

        def ok(g: int, i: int, k: int) -> bool:
            return self._own_short(g, i, k) <= slack and allowed(g, i, k)

        # state (j, i): groups so far cover [0, i), the last on [j, i); value: (least
        # end of the first group reaching it, start of the range before it)
        reach: dict[Range, tuple[int, int]] = {}
        for e in range(1, n - s + 2):
            if not ok(0, 0, e):
                break
            reach[(0, e)] = (e, -1)
        trail = [reach]
        for g in range(1, s):
            by_end: dict[int, list[tuple[int, int]]] = {}
            for (j, i), (e0, _) in reach.items():
                by_end.setdefault(i, []).append((j, e0))
            nxt: dict[Range, tuple[int, int]] = {}
            for i, prevs in sorted(by_end.items()):
                prevs.sort()
                suffix = list(prevs)  # suffix[t]: (start, least first end) over prevs[t:]
                for t in range(len(prevs) - 2, -1, -1):
                    if suffix[t + 1][1] < suffix[t][1]:
                        suffix[t] = suffix[t + 1]
                for k in range(i + 1, n - (s - 1 - g) + 1):
                    if not ok(g, i, k):
                        break  # longer ranges need more memory and time still
                    t = 0
                    if self.backs_up[g]:
                        room = self._room(g, i, k, slack)
                        t = bisect.bisect_left(
                            prevs, True, key=lambda p: self.layers.replica(p[0], i) <= room
                        )
                    if t < len(prevs):
                        j, e0 = suffix[t]
                        nxt[(i, k)] = (e0, j)
            reach = nxt
            trail.append(reach)
        ends = sorted(
            j
            for (j, i), (e0, _) in reach.items()
            if i == n and (not ring or self.layers.replica(j, n) <= self._room(0, 0, e0, slack))
        )
        if not ends:
            return None
        ranges = [(ends[0], n)]
        for g in range(s - 1, 0, -1):
            _, j = trail[g][ranges[-1]]
            ranges.append((j, ranges[-1][0]))
        return ranges[::-1]

    def peaks(self, ranges: list[Range]) -> dict[str, int]:
        """Each device's predicted peak under `ranges`, replicas included."""
        return {
            str(d): need
            for g, (lo, hi) in enumerate(ranges)
            for d, _, need in self.needs(g, lo, hi, ranges[g - 1])
        }

    def require_a_split(self, n: int) -> None:
        """Raise, naming layers, devices and bytes, unless some split fits every budget.

        The split reported is the one whose worst device lacks the fewest bytes:
        the least that would have to change for the survivors to go on.
        """
        if self.linked:
            ranges = self._closest(n)
            if ranges is None:
                return
        else:
            least, ranges = _minimax(n, len(self.members), self.shortfall)
            if least == 0:
                return
        lines = [
            f"layers [{lo}, {hi}): device {d} has {b} bytes, needs {need}"
            + self._replica_note(g, ranges, d)
            for g, (lo, hi) in enumerate(ranges)
            for d, b, need in self.needs(g, lo, hi, ranges[g - 1])
            if 0 < b < need
        ]
        raise RecoveryImpossible(
            "survivors cannot hold "
            + "; ".join(lines)
            + " (the split closest to fitting; more memory or more devices are needed)"
        )

    def _closest(self, n: int) -> list[Range] | None:
        """None if a split fits, else the split whose worst device lacks the fewest bytes.

        Bisection on the bytes lacking, each step a `_feasible` programme.
        """
        if self._feasible(n, 0, lambda g, i, k: True) is not None:
            return None
        whole = max(need for g in range(len(self.members)) for _, _, need in self.needs(g, 0, n))
        lo, hi = 1, whole + self.layers.replica(0, n)
        best = self._feasible(n, hi, lambda g, i, k: True)
        while lo < hi:
            mid = (lo + hi) // 2
            got = self._feasible(n, mid, lambda g, i, k: True)
            if got is None:
                lo = mid + 1
            else:
                best, hi = got, mid
        return best

    def _replica_note(self, g: int, ranges: list[Range], device: DeviceId) -> str:
        """Which replica a device's need includes, so the message adds up."""
        if not self.backs_up[g] or device != self.members[g][0][0]:
            return ""
        lo, hi = ranges[g - 1]
        return f" with the replica of layers [{lo}, {hi})"


def survivors_plan(
    plan: Plan,
    lost: set[DeviceId],
    layer_costs: Sequence[float] | None = None,
    speeds: Mapping[DeviceId, float] | None = None,
    memory: MemoryInputs | None = None,
) -> Plan:
    """`plan` without the `lost` devices, its partition points moved by capacity.

    With `memory`, only splits where every survivor stays within its budget are
    considered, a backup node's replica of its single-device neighbour stage
    included: training on with a stage or a replica that cannot be held would
    only fail later, out of memory, on a device.

    Raises:
        RecoveryImpossible: No device survives, fewer layers than groups, or
            no split fits the survivors' memory (the message names the layers,
            the devices and the bytes they would need).

    """
    groups = [[a for a in stage.devices if a.device not in lost] for stage in plan.stages]
    groups = [g for g in groups if g]
    layers = plan.stages[-1].end
    costs = list(layer_costs) if layer_costs is not None else [1.0] * layers
    if len(costs) != layers:
        raise RecoveryImpossible(f"{len(costs)} layer costs for a model of {layers} layers")
    speed = speeds or {}
    capacity = [sum(speed.get(a.device, 1.0) for a in g) for g in groups]
    stage_memory: _StageMemory | None = None
    if memory is not None:
        if memory.layers.num_layers != layers:
            raise RecoveryImpossible(
                f"memory counts for {memory.layers.num_layers} layers, model has {layers}"
            )
        _check_shape(layers, len(groups))
        stage_memory = _StageMemory(plan, groups, memory)
        stage_memory.require_a_split(layers)
    if stage_memory is not None and stage_memory.linked:
        # a replica ties a group's memory to its neighbour's range, which `partition`'s
        # per-group check cannot see; the same objective, searched with the neighbour
        prefix = [0.0, *itertools.accumulate(costs)]
        ranges = stage_memory.split(layers, lambda g, j, i: (prefix[i] - prefix[j]) / capacity[g])
    else:
        ranges = partition(costs, capacity, stage_memory.fits if stage_memory else None)
    stages = [
        StageSpec(start=lo, end=hi, devices=g) for (lo, hi), g in zip(ranges, groups, strict=True)
    ]
    peaks = stage_memory.peaks(ranges) if stage_memory is not None else {}
    return plan.model_copy(
        update={
            "stages": stages,
            "planner": f"{plan.planner}+lightweight",
            "predicted_round_s": None,
            "predicted_peak_bytes": peaks,
        }
    )


def memory_inputs(
    cluster: ClusterSpec, profiles: Mapping[str, Profile], budgets: Mapping[DeviceId, int]
) -> MemoryInputs | None:
    """The model's per-layer bytes from any of the job's profiles, with `budgets`; None if none.

    Byte counts describe the model, not the device, so the first profile found
    serves for every device (as in the planner's cost model).
    """
    for device in cluster.devices:
        profile = profiles.get(device.profile)
        if profile is not None:
            return MemoryInputs(LayerMemory.from_profile(profile), dict(budgets))
    return None


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
