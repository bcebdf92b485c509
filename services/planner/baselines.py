"""Baseline planners from the papers Asteroid compares against, plus an exhaustive optimum.

Each baseline keeps what makes its paper's plans what they are (homogeneous
assumptions, even splits, fixed warm-ups) and drops what our plan format
cannot express; every class says which. Memory-unaware baselines return
their plan even when it does not fit (`check_memory` reports it); the
optimum is memory-aware and raises `PlanDoesNotFit`. Duan & Wu's planner has
its own module (`services.planner.duanwu`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from common.errors import ConfigError
from common.plan import Plan, StageSpec, split_ranges
from services.planner._partition import minmax_cuts
from services.planner._steps import total
from services.planner.balance import proportional
from services.planner.base import (
    PlanDoesNotFit,
    Planner,
    check_memory,
    finish,
    micro_size,
    require_fits_somewhere,
    stage,
)
from services.planner.cost import CostModel
from services.planner.simulator import simulate

__all__ = [
    "DapplePlanner",
    "DataParallelPlanner",
    "GPipePlanner",
    "HetPipePlanner",
    "OptimalPlanner",
    "PipeDreamPlanner",
]


def _by_speed(cost: CostModel, micro: int) -> list[str]:
    """Device names, fastest on the whole model first (ties by name)."""
    t = {d.name: cost.step(d.name, 0, cost.num_layers, micro) for d in cost.cluster.devices}
    return sorted(t, key=lambda d: (t[d], d))


def _uniform_allreduce(cost: CostModel, replicas: int, start: int, end: int) -> float:
    """Ring all-reduce over `replicas` identical devices on the default link."""
    if replicas <= 1:
        return 0.0
    per_step = cost.cluster.latency_s + cost.param_bytes(start, end) / replicas / (
        cost.cluster.bandwidth
    )
    return 2 * (replicas - 1) * per_step


def _uniform_comm(cost: CostModel, boundary: int, samples: int) -> float:
    """Activations plus gradients of `samples` across `boundary` on the default link."""
    one = cost.cluster.latency_s + cost.boundary_bytes(boundary, samples) / cost.cluster.bandwidth
    return 2 * one


class DataParallelPlanner(Planner):
    """Heterogeneity-balanced data parallelism, as EDDL (Hao & Zhang, 2021) does.

    One stage runs the whole model on every device, each device taking samples
    in proportion to its speed. Memory-unaware. With fewer samples per
    micro-batch than devices, only the fastest devices take part.
    """

    name = "dp"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """One data-parallel stage over (up to `micro`) devices."""
        micro = micro_size(global_batch, microbatches)
        devs = _by_speed(cost, micro)[:micro]
        counts = proportional(cost, devs, 0, cost.num_layers, micro)
        spec = stage(0, cost.num_layers, devs, counts)
        return finish(self.name, cost, [spec], global_batch, microbatches, memory_aware=False)


class GPipePlanner(Planner):
    """GPipe (Huang et al., NeurIPS'19): equal layer counts, one device per stage.

    Devices keep the cluster's order; all M micro-batches are in flight
    (K_p = M: every forward before any backward). Memory-unaware.
    """

    name = "gpipe"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """One stage per device (or per layer, if fewer), equal layer counts."""
        micro_size(global_batch, microbatches)
        num = min(len(cost.cluster.devices), cost.num_layers)
        devs = [d.name for d in cost.cluster.devices[:num]]
        spans = split_ranges(cost.num_layers, [1] * num)
        specs = [
            stage(lo, hi, [d], [1], warmup=microbatches)
            for (lo, hi), d in zip(spans, devs, strict=True)
        ]
        return finish(self.name, cost, specs, global_batch, microbatches, memory_aware=False)


class PipeDreamPlanner(Planner):
    """PipeDream's partitioner (Narayanan et al., SOSP'19) on identical devices.

    PipeDream's program A(j, m) = min over (i, m') of max(A(i, m - m'), C_i,
    T(i..j, m')): the slowest of the pipeline so far, the boundary transfer and
    a new stage of layers [i, j) replicated on m' machines. Every device is
    assumed to be the first device of the cluster, every link the default
    link. Simplifications: a replicated stage splits each micro-batch evenly
    (our HPP format) instead of round-robin micro-batches, so T is the step on
    ceil(micro / m') samples plus the stage's all-reduce amortised over the M
    micro-batches; the best A(L, m) over m <= N is taken, so devices may be
    left out; K_p = S - p (1F1B with PipeDream's NOAM in flight). Memory-unaware.
    """

    name = "pipedream"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """PipeDream's stage split and replication, devices assigned in cluster order."""
        micro = micro_size(global_batch, microbatches)
        layers, devs = cost.num_layers, [d.name for d in cost.cluster.devices]
        num, ref = len(devs), devs[0]
        reps = min(num, micro)
        pre = {
            r: [cost.step(ref, 0, j, math.ceil(micro / r)) for j in range(layers + 1)]
            for r in range(1, reps + 1)
        }

        def t(i: int, j: int, r: int) -> float:
            sync = _uniform_allreduce(cost, r, i, j) / microbatches
            return pre[r][j] - pre[r][i] + sync

        comm = [0.0] + [_uniform_comm(cost, i, micro) for i in range(1, layers)]
        inf = float("inf")
        best = [[inf] * (num + 1) for _ in range(layers + 1)]
        back: list[list[tuple[int, int]]] = [[(0, 0)] * (num + 1) for _ in range(layers + 1)]
        for j in range(1, layers + 1):
            for m in range(1, num + 1):
                if m <= reps:
                    best[j][m], back[j][m] = t(0, j, m), (0, m)
                for i in range(1, j):
                    row = best[i]
                    for r in range(1, min(m - 1, reps) + 1):
                        prev = row[m - r]
                        if prev >= best[j][m] or comm[i] >= best[j][m]:
                            continue
                        v = max(prev, comm[i], t(i, j, r))
                        if v < best[j][m]:
                            best[j][m], back[j][m] = v, (i, r)
        m = min(range(1, num + 1), key=lambda m: (best[layers][m], -m))
        spans: list[tuple[int, int, int]] = []
        j = layers
        while j > 0:
            i, r = back[j][m]
            spans.insert(0, (i, j, r))
            j, m = i, m - r
        specs, at = [], 0
        for p, (lo, hi, r) in enumerate(spans):
            specs.append(stage(lo, hi, devs[at : at + r], [1] * r, warmup=len(spans) - p))
            at += r
        return finish(self.name, cost, specs, global_batch, microbatches, memory_aware=False)


class DapplePlanner(Planner):
    """DAPPLE's planner (Fan et al., PPoPP'21) under its homogeneous assumption.

    For every stage count S, the devices are split evenly among stages (in
    cluster order), layers are split so that the slowest stage on the first
    device's profile is fastest, and S is the one minimising DAPPLE's latency
    estimate on identical devices and default links. K_p = S - p (DAPPLE's
    early backward). Its device placement policies (fresh/append/scatter) and
    uneven replication are not modelled. Memory-unaware.
    """

    name = "dapple"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The stage count and split with DAPPLE's lowest estimate."""
        micro = micro_size(global_batch, microbatches)
        layers, devs = cost.num_layers, [d.name for d in cost.cluster.devices]
        ref = devs[0]
        best: tuple[float, list[int], list[int]] | None = None
        for parts in range(1, min(len(devs), layers) + 1):
            used = min(len(devs), parts * micro)
            reps = [hi - lo for lo, hi in split_ranges(used, [1] * parts)]

            def stage_cost(s: int, i: int, j: int, reps: list[int] = reps) -> float:
                return cost.step(ref, i, j, math.ceil(micro / reps[s]))

            cuts = minmax_cuts(layers, parts, stage_cost)
            steps = [stage_cost(s, cuts[s], cuts[s + 1]) for s in range(parts)]
            steps += [_uniform_comm(cost, c, micro) for c in cuts[1:-1]]
            red = max(_uniform_allreduce(cost, reps[s], cuts[s], cuts[s + 1]) for s in range(parts))
            est = total(sum(steps), max(steps), red, microbatches)
            if best is None or est < best[0]:
                best = (est, cuts, reps)
        if best is None:  # pragma: no cover - parts=1 always runs
            raise AssertionError("no stage count tried")
        _, cuts, reps = best
        specs, at = [], 0
        for p, r in enumerate(reps):
            specs.append(
                stage(cuts[p], cuts[p + 1], devs[at : at + r], [1] * r, warmup=len(reps) - p)
            )
            at += r
        return finish(self.name, cost, specs, global_batch, microbatches, memory_aware=False)


class HetPipePlanner(Planner):
    """HetPipe (Park et al., ATC'20): virtual workers of heterogeneous devices.

    The devices form k virtual workers (VWs), each a pipeline with one device
    per stage; the VWs train data-parallel. As an HPP plan, stage s holds one
    device of every VW with equal shares, so each VW is its own pipeline over
    aligned layer ranges. Devices are dealt by speed (HetPipe's "equal
    distribution" policy): stage s gets the s-th fastest tier of k devices,
    so all VWs are alike; layers are split so that the slowest tier member's
    stage time is balanced; k is the one with the lowest estimate, devices
    left over by N mod k are not used. HetPipe's parameter-server
    synchronisation (WSP) is approximated by each stage group's all-reduce,
    and its per-VW layer split by one split shared by all VWs. Memory-unaware.
    """

    name = "hetpipe"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The virtual-worker count and layer split with the lowest estimate."""
        micro = micro_size(global_batch, microbatches)
        layers, devs = cost.num_layers, _by_speed(cost, micro)
        best: Plan | None = None
        for k in range(1, min(len(devs), micro) + 1):
            parts = min(len(devs) // k, layers)
            tiers = [devs[s * k : (s + 1) * k] for s in range(parts)]
            share = math.ceil(micro / k)

            def stage_cost(
                s: int, i: int, j: int, tiers: list[list[str]] = tiers, share: int = share
            ) -> float:
                return max(cost.step(d, i, j, share) for d in tiers[s])

            cuts = minmax_cuts(layers, parts, stage_cost)
            specs = [stage(cuts[s], cuts[s + 1], tiers[s], [1] * k) for s in range(parts)]
            got = finish(self.name, cost, specs, global_batch, microbatches, memory_aware=False)
            if best is None or (got.predicted_round_s or 0.0) < (best.predicted_round_s or 0.0):
                best = got
        if best is None:  # pragma: no cover - k=1 always runs
            raise AssertionError("no virtual-worker count tried")
        return best


class OptimalPlanner(Planner):
    """Exhaustive search, the yardstick for small instances.

    Every sequence of ordered device groups (any subset of the devices, any
    order inside a group: it decides the routes), times every split of the
    layers into that many contiguous ranges, times every integer split of a
    micro-batch among each stage's devices (at least one sample each, checked
    against each budget with K_p = 2(S-p)-1, and whole plans against the
    budgets with backup replicas counted). Nothing of Asteroid's own
    search (Algorithm 1's `balance`, the dominant-step estimate) is used, so
    comparing the two is not comparing a part with itself. Candidates are
    scored by the discrete-event simulator, so "optimal" means fastest as the
    runtime would run it. They are replayed in order of a lower bound
    (`_lower_bound`), stopping once it reaches the best round found, which
    loses nothing. Raises ConfigError above `max_devices` devices,
    `max_layers` layers or `max_candidates` candidate plans.
    """

    name = "optimal"

    def __init__(
        self, max_devices: int = 5, max_layers: int = 10, max_candidates: int = 200_000
    ) -> None:
        self.max_devices = max_devices
        self.max_layers = max_layers
        self.max_candidates = max_candidates

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The fastest simulated plan that fits in memory."""
        num, layers = len(cost.cluster.devices), cost.num_layers
        if num > self.max_devices or layers > self.max_layers:
            raise ConfigError(
                f"planner {self.name} searches exhaustively: at most {self.max_devices} "
                f"devices and {self.max_layers} layers, got {num} devices and {layers} layers"
            )
        micro = micro_size(global_batch, microbatches)
        require_fits_somewhere(cost, micro)
        devs = [d.name for d in cost.cluster.devices]
        memo: dict[tuple[tuple[str, ...], int, int, int], list[_Shares]] = {}
        layouts: list[tuple[list[list[str]], list[int], list[list[_Shares]]]] = []
        for groups in _arrangements(devs, min(num, layers)):
            parts = len(groups)
            for inner in itertools.combinations(range(1, layers), parts - 1):
                cuts = [0, *inner, layers]
                options = []
                for p, group in enumerate(groups):
                    k = min(2 * (parts - p) - 1, microbatches)
                    key = (tuple(group), cuts[p], cuts[p + 1], k)
                    if key not in memo:
                        memo[key] = _all_shares(
                            cost, group, cuts[p], cuts[p + 1], micro, k, microbatches
                        )
                    options.append(memo[key])
                if all(options):
                    layouts.append((groups, cuts, options))
        count = sum(math.prod(len(o) for o in opts) for _, _, opts in layouts)
        if count > self.max_candidates:
            raise ConfigError(
                f"planner {self.name} searches exhaustively: at most {self.max_candidates} "
                f"candidate plans, got {count} ({num} devices, {layers} layers, "
                f"{micro}-sample micro-batches)"
            )
        # Best-first: a layout's bound takes each stage's best split, so it is below
        # every candidate it expands to; a candidate is simulated only while its own
        # bound is below the best round found, which loses nothing.
        heap: list[tuple[float, int, int, tuple[_Shares, ...]]] = []
        for i, (_, _, opts) in enumerate(layouts):
            heap.append((_lower_bound([_fastest(o) for o in opts]), i, i, ()))
        heapq.heapify(heap)
        seq = len(heap)
        best: tuple[float, list[StageSpec]] | None = None
        while heap:
            bound, _, i, combo = heapq.heappop(heap)
            if best is not None and bound >= best[0]:
                break
            groups, cuts, opts = layouts[i]
            if not combo:
                for c in itertools.product(*opts):
                    heapq.heappush(heap, (_lower_bound(c), seq, i, c))
                    seq += 1
                continue
            specs = [stage(cuts[p], cuts[p + 1], groups[p], c.counts) for p, c in enumerate(combo)]
            plan = Plan(
                stages=specs,
                global_batch=global_batch,
                microbatches=microbatches,
                planner=self.name,
            )
            if check_memory(plan, cost):  # a backup node's replica overflows its budget
                continue
            score = simulate(plan, cost).round_s
            if best is None or score < best[0]:
                best = (score, specs)
        if best is None:
            raise PlanDoesNotFit(
                f"planner {self.name}: no arrangement of {num} devices holds the "
                f"{layers}-layer model for a {micro}-sample micro-batch within the budgets"
            )
        return finish(self.name, cost, best[1], global_batch, microbatches, memory_aware=True)


@dataclass(frozen=True, slots=True)
class _Shares:
    """One integer split of a stage's micro-batch and what bounds its round from below.

    `busy` is the slowest member's M forwards and backwards, `first_f` and
    `first_b` the quickest member's forward and backward of its share, and
    `reduce` the group's all-reduce.
    """

    counts: tuple[int, ...]
    busy: float
    first_f: float
    first_b: float
    reduce: float


def _all_shares(
    cost: CostModel,
    group: Sequence[str],
    start: int,
    end: int,
    micro: int,
    in_flight: int,
    microbatches: int,
) -> list[_Shares]:
    """Every split of `micro` samples among `group` (each >= 1) that fits every budget."""
    reduce = cost.allreduce(group, start, end)
    out = []
    for counts in _compositions(micro, len(group)):
        if any(
            cost.memory(start, end, c, in_flight) > cost.cluster.device(d).memory_bytes
            for d, c in zip(group, counts, strict=True)
        ):
            continue
        f = [cost.compute(d, start, end, c, "F") for d, c in zip(group, counts, strict=True)]
        b = [cost.compute(d, start, end, c, "B") for d, c in zip(group, counts, strict=True)]
        busy = microbatches * max(x + y for x, y in zip(f, b, strict=True))
        out.append(_Shares(counts, busy, min(f), min(b), reduce))
    return out


def _fastest(options: Sequence[_Shares]) -> _Shares:
    """The best of each field over a stage's splits: bounds every one of them."""
    return _Shares(
        counts=(),
        busy=min(o.busy for o in options),
        first_f=min(o.first_f for o in options),
        first_b=min(o.first_b for o in options),
        reduce=min(o.reduce for o in options),
    )


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of `parts` positive integers summing to `total`."""
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(hi - lo for lo, hi in itertools.pairwise(edges))


def _lower_bound(stages: Sequence[_Shares]) -> float:
    """A round time no schedule of these stages can beat.

    A device of stage p runs its M forwards and backwards one at a time; it
    cannot start before a forward of every earlier stage produced its first
    input, and its last backward is followed by a backward of every earlier
    stage (the gradient flowing back) and by its group's all-reduce.
    Transfers only add to this.
    """
    bound, fill, drain = 0.0, 0.0, 0.0
    for s in stages:
        bound = max(bound, fill + s.busy + max(drain, s.reduce))
        fill += s.first_f
        drain += s.first_b
    return bound


def _arrangements(devs: Sequence[str], max_parts: int) -> Iterator[list[list[str]]]:
    """Every sequence of <= max_parts ordered groups of distinct devices from `devs`.

    A group's order matters: it decides which samples of a micro-batch each
    member gets, and so the routes to the neighbouring stages.
    """
    for size in range(1, len(devs) + 1):
        for line in itertools.permutations(devs, size):
            for parts in range(1, min(size, max_parts) + 1):
                for inner in itertools.combinations(range(1, size), parts - 1):
                    edges = (0, *inner, size)
                    yield [list(line[lo:hi]) for lo, hi in itertools.pairwise(edges)]
