"""Asteroid's planner (MobiCom'24, §3.3): dynamic programming over layers, devices, stages.

Devices are sorted by memory, largest first: in 1F1B an earlier stage keeps
more micro-batches alive (K_p = 2(S-p)-1), so it should sit on the devices that
can afford them. A stage is a contiguous layer range on a contiguous block of
that order, its micro-batch split by Algorithm 1 (`balance`); a device may also
be left out when the pipeline is faster without it.

The program runs from the output end. Its state is (layers [l, L), the devices
still free, q stages), and q alone fixes the K of the state's first stage,
2q-1 capped at M, whatever the total stage count: that is what lets one pass
price memory for every S at once. The objective (the dominant-step estimate:
sum of steps + (M-1) * max step + max all-reduce, `simulator.estimate`) is not
additive, so a state keeps a small Pareto front of partial plans over (sum,
max, all-reduce) rather than one best value; the boundary step to the next
stage is priced exactly when a stage is prepended.

Beyond the paper (Asteroid-Edge additions, each can be turned off):
  * Small instances (3^devices x boundaries^2 <= `subset_budget`) let a group
    be any subset of the free devices, not only a block of the memory order,
    so the program spans every ordered partition of every device subset.
  * The best `shortlist` complete plans by the estimate are replayed in the
    simulator, and a simulator-scored local search polishes the fastest
    (`_polish`): the estimate is off the simulated 1F1B round by -10%..+55%,
    enough to rank near-equal plans wrongly.
  * Backups (Asteroid Fig. 9, §3.4 (2)): the program cannot see the replica a
    group's first device holds for its neighbour, so complete plans are
    charged for it and refitted, or dropped, before the simulator sees them.

Pruning, for speed on deep models (documented so results can be judged):
  * With more than `max_cuts` layers, stage boundaries are restricted to about
    `max_cuts` candidates (equal shares of the fastest device's compute time,
    plus the cheapest-to-send boundary between each pair); the chosen cuts are
    then refined by hill climbing each boundary over every layer between its
    neighbours' candidates, with the device groups fixed.
  * A Pareto front keeps at most `front` partial plans (the best by the
    estimate they would have if they were the whole plan).
  * Memory need grows with the layer range, so once a range does not fit a
    device group, longer ranges on that group are not tried.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.errors import PlanError
from common.plan import Plan
from services.planner._polish import Layout, Retune, polish
from services.planner._steps import comm_time, total
from services.planner.balance import Balanced, balance, fit_backups
from services.planner.base import (
    Planner,
    finish,
    micro_size,
    require_fits_somewhere,
    stage,
)
from services.planner.cost import CostModel
from services.planner.simulator import simulate

__all__ = ["AsteroidPlanner", "balance"]


@dataclass(frozen=True, slots=True)
class _Stage:
    start: int
    end: int
    devices: tuple[str, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Partial:
    """A plan of the last layers: its first stage, the rest, and the step aggregates."""

    total: float  # sum of steps
    worst: float  # largest step
    reduce: float  # largest all-reduce
    first: _Stage
    rest: _Partial | None

    def stages(self) -> list[_Stage]:
        out = [self.first]
        node = self.rest
        while node is not None:
            out.append(node.first)
            node = node.rest
        return out


class _Search:
    """One run of Algorithm 2 over candidate cuts, with device groups as bit masks.

    Bit i stands for `order[i]`. In the paper's mode a group is a contiguous
    block of the memory order and the devices before it are left out for good
    (so the state's device set is a suffix of the order); with `subsets` a
    group is any subset of the devices still free, which makes the program
    cover every ordered partition of every subset of devices.
    """

    def __init__(
        self,
        cost: CostModel,
        order: list[str],
        micro: int,
        m: int,
        *,
        memory: bool,
        front: int,
        subsets: bool,
    ) -> None:
        self.cost, self.order, self.micro, self.m = cost, order, micro, m
        self.memory, self.front, self.subsets = memory, front, subsets
        self._devices: dict[int, tuple[str, ...]] = {}
        self._moves: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        self._balanced: dict[tuple[int, int, int, int], Balanced | None] = {}
        self._reduce: dict[tuple[int, int, int], float] = {}
        self._comm: dict[tuple[tuple[str, ...], tuple[int, ...], _Stage], float] = {}

    def devices(self, mask: int) -> tuple[str, ...]:
        """The devices of `mask`, in memory order."""
        if mask not in self._devices:
            self._devices[mask] = tuple(d for i, d in enumerate(self.order) if mask >> i & 1)
        return self._devices[mask]

    def moves(self, free: int) -> tuple[int, list[tuple[int, int]]]:
        """The moves from state `free` (the devices still free).

        Returns the state that leaves one device out for good (0: none) and
        each (group, devices still free after it) choice for the next stage.
        """
        if free not in self._moves:
            if self.subsets:
                groups, g = [], free
                while g:
                    groups.append((g, free & ~g))
                    g = (g - 1) & free
                self._moves[free] = (0, groups)
            else:
                low = free & -free
                blocks, g = [], 0
                bit = low
                while bit & free:
                    g |= bit
                    blocks.append((g, free & ~g))
                    bit <<= 1
                self._moves[free] = (free ^ low, blocks)
        return self._moves[free]

    def balanced(self, start: int, end: int, mask: int, q: int) -> Balanced | None:
        """Algorithm 1 for group `mask` on [start, end) as the q-th stage from the end."""
        kp = min(2 * q - 1, self.m)
        key = (start, end, mask, kp if self.memory else 0)
        if key not in self._balanced:
            devs = self.devices(mask)
            free_key = (start, end, mask, 0)  # the split for speed alone, K-independent
            if free_key not in self._balanced:
                self._balanced[free_key] = balance(
                    self.cost, devs, start, end, self.micro, kp, memory=False
                )
            got = self._balanced[free_key]
            if got is not None and self.memory:
                got = balance(self.cost, devs, start, end, self.micro, kp, free=got)
            self._balanced[key] = got
        return self._balanced[key]

    def reduce(self, start: int, end: int, mask: int) -> float:
        key = (start, end, mask)
        if key not in self._reduce:
            self._reduce[key] = self.cost.allreduce(self.devices(mask), start, end)
        return self._reduce[key]

    def comm(self, devs: tuple[str, ...], counts: tuple[int, ...], nxt: _Stage) -> float:
        key = (devs, counts, nxt)
        if key not in self._comm:
            self._comm[key] = comm_time(self.cost, nxt.start, devs, counts, nxt.devices, nxt.counts)
        return self._comm[key]

    def run(self, cuts: list[int]) -> list[_Partial]:
        """Partial plans covering every layer: the best few for each stage count."""
        num = len(self.order)
        full = (1 << num) - 1
        if self.subsets:
            states = list(range(1, full + 1))
        else:
            states = sorted(full & ~((1 << n) - 1) for n in range(num))
        last = len(cuts) - 1  # cuts[last] == L
        table: dict[tuple[int, int, int], list[_Partial]] = {}
        for li in range(last - 1, -1, -1):
            lo = cuts[li]
            for free in states:  # ascending: the left-out state is smaller, so done
                skip, groups = self.moves(free)
                for q in range(1, min(free.bit_count(), last - li) + 1):
                    cands = list(table.get((li, skip, q), ())) if skip else []
                    # the last stage ends the model; others leave a layer per later stage
                    ends = [last] if q == 1 else range(li + 1, last - q + 2)
                    for group, rest_free in groups:
                        if q > 1 and rest_free.bit_count() < q - 1:
                            continue
                        devs = self.devices(group)
                        for lj in ends:
                            rests = table.get((lj, rest_free, q - 1), []) if q > 1 else []
                            if q > 1 and not rests:
                                continue
                            hi = cuts[lj]
                            got = self.balanced(lo, hi, group, q)
                            if got is None:
                                break  # longer ranges need more memory still
                            first = _Stage(lo, hi, devs, got.counts)
                            red = self.reduce(lo, hi, group)
                            if q == 1:
                                cands.append(_Partial(got.time, got.time, red, first, None))
                            for rest in rests:
                                c = self.comm(devs, got.counts, rest.first)
                                cands.append(
                                    _Partial(
                                        rest.total + got.time + c,
                                        max(rest.worst, got.time, c),
                                        max(rest.reduce, red),
                                        first,
                                        rest,
                                    )
                                )
                    if cands:
                        table[li, free, q] = self._pareto(cands, self.m)
        return [p for q in range(1, num + 1) for p in table.get((0, full, q), ())]

    def _pareto(self, cands: list[_Partial], m: int) -> list[_Partial]:
        """The best `front` non-dominated partial plans over (sum, max, all-reduce).

        Sorted by the estimate each would have as a whole plan, a candidate can
        only be dominated by an earlier one, and (dominance being transitive)
        checking the kept ones suffices.
        """
        cands.sort(key=lambda p: total(p.total, p.worst, p.reduce, m))
        kept: list[_Partial] = []
        for p in cands:
            if not any(
                k.total <= p.total and k.worst <= p.worst and k.reduce <= p.reduce for k in kept
            ):
                kept.append(p)
                if len(kept) == self.front:
                    break
        return kept

    def score(self, stages: list[_Stage]) -> float:
        """The dominant-step estimate of complete stages, as `simulator.estimate` sums it."""
        steps, red = [], 0.0
        for i, s in enumerate(stages):
            if i:
                prev = stages[i - 1]
                steps.append(self.comm(prev.devices, prev.counts, s))
            steps.append(
                max(
                    self.cost.step(d, s.start, s.end, c)
                    for d, c in zip(s.devices, s.counts, strict=True)
                )
            )
            red = max(red, self.cost.allreduce(s.devices, s.start, s.end))
        return total(sum(steps), max(steps), red, self.m)

    def refine(self, stages: list[_Stage], window: int) -> list[_Stage]:
        """Hill-climb each boundary within `window` layers, device groups fixed."""
        best, best_s = stages, self.score(stages)
        improved = True
        while improved:
            improved = False
            for i in range(len(best) - 1):
                a, b = best[i], best[i + 1]
                q_a, q_b = len(best) - i, len(best) - i - 1
                for cut in range(
                    max(a.start + 1, a.end - window), min(b.end - 1, a.end + window) + 1
                ):
                    if cut == a.end:
                        continue
                    ga = balance(
                        self.cost,
                        a.devices,
                        a.start,
                        cut,
                        self.micro,
                        min(2 * q_a - 1, self.m),
                        memory=self.memory,
                    )
                    gb = balance(
                        self.cost,
                        b.devices,
                        cut,
                        b.end,
                        self.micro,
                        min(2 * q_b - 1, self.m),
                        memory=self.memory,
                    )
                    if ga is None or gb is None:
                        continue
                    trial = list(best)
                    trial[i] = _Stage(a.start, cut, a.devices, ga.counts)
                    trial[i + 1] = _Stage(cut, b.end, b.devices, gb.counts)
                    s = self.score(trial)
                    if s < best_s * (1 - 1e-12):
                        best, best_s, improved = trial, s, True
                        a, b = trial[i], trial[i + 1]
        return best


def candidate_cuts(cost: CostModel, device: str, micro: int, max_cuts: int) -> list[int]:
    """Stage boundaries the program may use: all of them, or about `max_cuts` for deep models.

    Half are equal shares of `device`'s compute time over the model; between
    each two of those, the boundary with the fewest bytes to send (ties: the
    middle one) is added.
    """
    layers = cost.num_layers
    if layers <= max_cuts:
        return list(range(layers + 1))
    parts = max(2, max_cuts // 2)
    whole = cost.step(device, 0, layers, micro)
    quantiles = {0, layers}
    at = 0
    for j in range(1, parts):
        goal = whole * j / parts
        while at < layers and cost.step(device, 0, at, micro) < goal:
            at += 1
        quantiles.add(at)
    anchors = sorted(quantiles)
    cuts = set(anchors)
    for lo, hi in itertools.pairwise(anchors):
        inner = range(lo + 1, hi)
        if inner:
            mid = (lo + hi) / 2
            cuts.add(min(inner, key=lambda c: (cost.boundary_bytes(c, 1), abs(c - mid))))
    return sorted(cuts)


class AsteroidPlanner(Planner):
    """Asteroid's memory-aware HPP planner (Algorithms 1 and 2).

    Args:
        max_cuts: Deeper models get about this many candidate stage boundaries.
        front: Partial plans kept per state of the program.
        subset_budget: When 3^devices x boundaries^2 is at most this, groups may
            be any device subsets (the paper's contiguous memory-order blocks
            otherwise): small clusters get the wider search for free.
        shortlist: Complete plans, best by the estimate, that the simulator
            replays to pick the final one (the estimate's runner-up can run
            faster; see `_polish`).
        polish_budget: Simulations the local search after the program may
            spend (0: return the program's pick as the paper does).

    """

    name = "asteroid"

    def __init__(
        self,
        max_cuts: int = 40,
        front: int = 4,
        subset_budget: int = 200_000,
        shortlist: int = 8,
        polish_budget: int = 300,
    ) -> None:
        self.max_cuts = max_cuts
        self.front = front
        self.subset_budget = subset_budget
        self.shortlist = shortlist
        self.polish_budget = polish_budget

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The fastest plan found that fits every memory budget."""
        micro = micro_size(global_batch, microbatches)
        require_fits_somewhere(cost, micro)
        speed = {d.name: cost.step(d.name, 0, cost.num_layers, micro) for d in cost.cluster.devices}
        order = sorted(speed, key=lambda d: (-cost.cluster.device(d).memory_bytes, speed[d], d))
        cuts = candidate_cuts(cost, min(speed, key=speed.__getitem__), micro, self.max_cuts)
        window = max(b - a for a, b in itertools.pairwise(cuts))
        subsets = 3 ** len(order) * len(cuts) ** 2 <= self.subset_budget

        def build(stages: list[_Stage]) -> Plan:
            specs = [stage(s.start, s.end, s.devices, s.counts) for s in stages]
            return finish(self.name, cost, specs, global_batch, microbatches, memory_aware=True)

        def fitted(stages: list[_Stage]) -> Plan | None:
            """The plan of `stages`, splits fitted around its replicas; None if one overflows."""
            specs = [stage(s.start, s.end, s.devices, s.counts) for s in stages]
            raw = Plan(stages=specs, global_batch=global_batch, microbatches=microbatches)
            got = fit_backups(cost, raw)
            if got is None:
                return None
            specs = list(got.stages)
            return finish(self.name, cost, specs, global_batch, microbatches, memory_aware=True)

        # A small program (the subset one) affords twice the front and a longer shortlist.
        front, shortlist = (
            (2 * self.front, 3 * self.shortlist // 2) if subsets else (self.front, self.shortlist)
        )
        search = _Search(
            cost, order, micro, microbatches, memory=True, front=front, subsets=subsets
        )
        found = search.run(cuts)
        if found:
            ranked = sorted((p.stages() for p in found), key=search.score)
            plans = self._shortlist(search, ranked, shortlist, window, fitted)
            if not plans:
                build(ranked[0])  # raises PlanDoesNotFit, naming the backup that overflows
            plans.sort(key=lambda p: simulate(p, cost).round_s)
            best = plans[0]
            if self.polish_budget:
                retune = self._retune(search, microbatches) if subsets else None
                best, _ = polish(cost, plans, self.polish_budget, order, retune)
            return finish(
                self.name, cost, list(best.stages), global_batch, microbatches, memory_aware=True
            )
        # Nothing fits: plan without budgets, only to report where and by how much it overshoots.
        search = _Search(
            cost, order, micro, microbatches, memory=False, front=self.front, subsets=subsets
        )
        found = search.run(cuts)
        if not found:
            raise PlanError(
                f"no stage can run a {micro}-sample micro-batch on any group of the "
                f"{len(order)} devices"
            )
        return build(min((p.stages() for p in found), key=search.score))  # raises PlanDoesNotFit

    @staticmethod
    def _shortlist(
        search: _Search,
        ranked: list[list[_Stage]],
        most: int,
        window: int,
        fitted: Callable[[list[_Stage]], Plan | None],
    ) -> list[Plan]:
        """Up to `most` of the program's plans, best first, that fit with their backups.

        The program splits each group without seeing the replica its first
        device may hold for the neighbouring stage (Asteroid Fig. 9: the last
        stage's lands on the first stage), so backups are charged here, on whole
        plans: each is refitted around its replicas (`fit_backups`), refined
        boundaries first and the program's own if those overflow, and dropped
        when neither fits; the rest of the ranking stands in for it.
        """
        plans: list[Plan] = []
        for stages in ranked:
            tries = [search.refine(stages, window), stages] if window > 1 else [stages]
            plan = next((p for p in map(fitted, tries) if p is not None), None)
            if plan is not None:
                plans.append(plan)
                if len(plans) == most:
                    break
        return plans

    @staticmethod
    def _retune(search: _Search, microbatches: int, most: int = 64) -> Retune:
        """The polish's compound move: the best boundaries, by the estimate, for given groups.

        Tries every split of the layers when there are at most `most` of them
        (a regrouping can make the old boundaries overflow memory), otherwise
        hill-climbs from the old boundaries.
        """
        layers = search.cost.num_layers

        def fitted(cuts: Sequence[int], groups: list[tuple[str, ...]]) -> list[_Stage] | None:
            stages = []
            spans = list(itertools.pairwise(cuts))
            for q, (lo, hi), devs in zip(range(len(groups), 0, -1), spans, groups, strict=True):
                got = balance(search.cost, devs, lo, hi, search.micro, min(2 * q - 1, microbatches))
                if got is None:
                    return None
                stages.append(_Stage(lo, hi, devs, got.counts))
            return stages

        def retune(layout: Layout) -> Layout | None:
            groups = [devs for _, _, devs in layout]
            if math.comb(layers - 1, len(groups) - 1) <= most:
                splits = (
                    fitted([0, *inner, layers], groups)
                    for inner in itertools.combinations(range(1, layers), len(groups) - 1)
                )
                found = [s for s in splits if s is not None]
                if not found:
                    return None
                best = min(found, key=search.score)
            else:
                start = fitted([0, *(hi for _, hi, _ in layout)], groups)
                if start is None:
                    return None
                best = search.refine(start, layers)
            return tuple((s.start, s.end, s.devices) for s in best)

        return retune
