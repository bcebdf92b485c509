"""Duan & Wu's planner: forward/backward resource split, binary-searched partition, grouping.

Model (Duan & Wu, "Optimizing Resource Allocation in Pipeline Parallelism for
Distributed DNN Training", Sec. III-B): a device gives a fraction beta of its
compute to forward and 1 - beta to backward and runs both at once; a phase
given a share s of the device takes its whole-device time divided by s. So a
stage's forward lasts F / beta, its backward B / (1 - beta), and Theorem 1's
optimum makes them equal: beta = F / (F + B), both lasting F + B.

Algorithm 1 binary-searches the bound x on every stage's longest operation:
compute under the optimal split (plus the group's all-reduce spread over the
round's micro-batches), the activation/gradient transfer at its end, and
memory (each member must hold its share with the stage's K_p in flight). The
feasibility check is the paper's greedy (longest prefix per stage); where
communication or memory make it miss, a frontier search (the same greedy
keeping every reachable cut) decides, so the bound is exact. Algorithm 2 builds
q device groups the paper's way (the slowest group takes the device that
speeds it up most) and then improves them by local search (moves, swaps and
stage-order swaps accepted while they lower Algorithm 1's bound).

The plan carries each device's beta as its allocation's `forward_share`, so
the workers run the split and the simulator scores the plan as they run it.
The model's premise (a share of the device runs a phase proportionally
faster) fails where the device does not really divide: on one core the two
lanes time-slice. So a device is split only where its profile carries a
measured gain of the split (`Profile.split_gain`, from
`services.worker.split_gain`) above `SPLIT_MARGIN`; elsewhere it runs one
task at a time, and `split_reasons` says why for each device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from common.errors import ConfigError, PlanError
from common.plan import Plan, StageSpec, routes
from services.planner.balance import balance, capacity, fit_backups, proportional
from services.planner.base import (
    PlanDoesNotFit,
    Planner,
    finish,
    micro_size,
    require_fits_somewhere,
    stage,
)
from services.planner.cost import CostModel
from services.planner.duanwu_split import (
    BETA_RANGE,
    SPLIT_MARGIN,
    betas,
    clip_beta,
    log_split,
    optimal_beta,
    split_cost,
    split_peaks,
    split_reasons,
    split_specs,
    split_time,
)
from services.planner.simulator import SimResult, simulate

__all__ = [
    "BETA_RANGE",
    "SPLIT_MARGIN",
    "DuanWuPlanner",
    "Grouping",
    "Partition",
    "StageTerms",
    "algorithm1",
    "algorithm2",
    "brute_force_grouping",
    "clip_beta",
    "concurrent_round",
    "initial_grouping",
    "optimal_beta",
    "split_cost",
    "split_peaks",
    "split_reasons",
    "split_specs",
    "split_time",
]

INF = float("inf")
_REL_TOL = 1e-9  # binary search stops when the bracket is this small, relative


def _device_time(cost: CostModel, device: str, lo: int, hi: int, samples: int) -> float:
    """A device's per-micro-batch time on `samples` samples under its optimal split."""
    f = cost.compute(device, lo, hi, samples, "F")
    b = cost.compute(device, lo, hi, samples, "B")
    return split_time(f, b, optimal_beta(f, b))


def _in_flight(position: int, depth: int, microbatches: int) -> int:
    """K_p of stage `position` of `depth`: the plan's default 2(S - p) - 1, capped at M."""
    return max(1, min(2 * (depth - position) - 1, microbatches))


@dataclass
class StageTerms:
    """Algorithm 1's per-stage terms for fixed ordered groups, memoised across searches.

    `compute(p, lo, hi)` is the group's time with its members' shares in
    proportion to speed (the paper sums a group's resources) plus its
    all-reduce over the M micro-batches, or inf if no integer split of the
    micro-batch fits the members' memory with K_p in flight. `comm(p, hi)` is
    the longer direction of the transfer after layer hi - 1 on the slowest
    link between the groups, each sender carrying an even part of the samples.
    """

    cost: CostModel
    groups: tuple[tuple[str, ...], ...]
    micro: int
    microbatches: int
    memo: dict[tuple[tuple[str, ...], int, int, int], float] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        self.depth = len(self.groups)
        self._ks = [_in_flight(p, self.depth, self.microbatches) for p in range(self.depth)]
        self._comm: list[list[float] | None] = [None] * self.depth

    def compute(self, p: int, lo: int, hi: int) -> float:
        """Stage p's compute-and-sync term on layers [lo, hi), inf if it does not fit."""
        key = (self.groups[p], self._ks[p], lo, hi)
        got = self.memo.get(key)
        if got is None:
            got = self._compute(p, lo, hi)
            self.memo[key] = got
        return got

    def _compute(self, p: int, lo: int, hi: int) -> float:
        group, cost = self.groups[p], self.cost
        if len(group) > self.micro or not self._fits(p, lo, hi):
            return INF
        times = [_device_time(cost, d, lo, hi, self.micro) for d in group]
        rate = sum(INF if t == 0 else 1 / t for t in times)
        return 1 / rate + cost.allreduce(list(group), lo, hi) / self.microbatches

    def _fits(self, p: int, lo: int, hi: int) -> bool:
        """Whether some split, each member >= 1 sample, fits every budget (as `balance`)."""
        k = self._ks[p]
        limit = self.micro - len(self.groups[p]) + 1
        caps = [min(limit, capacity(self.cost, d, lo, hi, k)) for d in self.groups[p]]
        return min(caps) >= 1 and sum(caps) >= self.micro

    def comm(self, p: int, hi: int) -> float:
        """Seconds of the boundary after stage p ending at `hi` (0 for the last layer)."""
        row = self._comm[p]
        if row is None:
            row = [self._boundary(p, h) for h in range(self.cost.num_layers + 1)]
            self._comm[p] = row
        return row[hi]

    def _boundary(self, p: int, hi: int) -> float:
        if hi >= self.cost.num_layers or hi == 0 or p + 1 >= self.depth:
            return 0.0
        src, dst = self.groups[p], self.groups[p + 1]
        nbytes = self.cost.boundary_bytes(hi, math.ceil(self.micro / len(src)))
        return max(
            max(self.cost.transfer(a, b, nbytes), self.cost.transfer(b, a, nbytes))
            for a in src
            for b in dst
        )

    def term(self, p: int, lo: int, hi: int) -> float:
        """The stage's longest operation: the quantity Algorithm 1 bounds."""
        return max(self.compute(p, lo, hi), self.comm(p, hi))


@dataclass(frozen=True, slots=True)
class Partition:
    """Algorithm 1's answer: the bound, the cuts 0 = c_0 < ... < c_q = L, and the groups.

    `greedy` says whether the paper's greedy alone found a partition at the
    bound; `terms` are the stages' longest operations (the bound is their max).
    """

    bound: float
    cuts: tuple[int, ...]
    groups: tuple[tuple[str, ...], ...]
    greedy: bool
    terms: tuple[float, ...] = ()

    @property
    def key(self) -> tuple[float, ...]:
        """Stage terms, longest first: ties on the bound go to the less loaded pipeline."""
        return tuple(sorted(self.terms, reverse=True))

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Layer range [lo, hi) of every stage."""
        return list(itertools.pairwise(self.cuts))


def _ends(terms: StageTerms, p: int, lo: int, x: float) -> Iterator[int]:
    """Ends hi of stage p from `lo` whose terms stay within `x`, leaving a layer per later stage.

    Compute and memory only grow with hi (so the scan stops at the first
    overrun); the transfer depends on the cut alone, so it filters.
    """
    last = terms.cost.num_layers - (terms.depth - 1 - p)
    for hi in range(lo + 1, last + 1):
        step = terms.compute(p, lo, hi)
        if step > x or step == INF:  # inf: the range does not fit in memory
            return
        if terms.comm(p, hi) <= x:
            yield hi


def _greedy(terms: StageTerms, x: float) -> tuple[int, ...] | None:
    """The paper's check: each stage takes the longest feasible run of layers."""
    cuts, lo = [0], 0
    for p in range(terms.depth):
        hi = max(_ends(terms, p, lo, x), default=None)
        if hi is None:
            return None
        cuts.append(hi)
        lo = hi
    return tuple(cuts) if lo == terms.cost.num_layers else None


def _frontier(terms: StageTerms, x: float) -> tuple[int, ...] | None:
    """Exact check: every cut reachable after each stage, then one path back.

    The longest run from a start only grows with the start (a sub-range is no
    slower and no bigger), so one sweep per stage finds all reachable cuts.
    """
    back: list[dict[int, int]] = []
    reach = [0]
    layers = terms.cost.num_layers
    for p in range(terms.depth):
        last = layers - (terms.depth - 1 - p)
        nxt: dict[int, int] = {}
        covered = 0
        for lo in reach:
            hi = max(lo, covered)
            while hi < last:
                step = terms.compute(p, lo, hi + 1)
                if step > x or step == INF:
                    break
                hi += 1
                if terms.comm(p, hi) <= x:
                    nxt.setdefault(hi, lo)
            covered = max(covered, hi)
        back.append(nxt)
        reach = sorted(nxt)
    if layers not in back[-1]:
        return None
    cuts = [layers]
    for step_back in reversed(back):
        cuts.append(step_back[cuts[-1]])
    return tuple(reversed(cuts))


def _check(terms: StageTerms, x: float) -> tuple[tuple[int, ...], bool] | None:
    """A partition within `x` and whether the paper's greedy alone found it, or None."""
    cuts = _greedy(terms, x)
    if cuts is not None:
        return cuts, True
    cuts = _frontier(terms, x)
    return None if cuts is None else (cuts, False)


def _bound(terms: StageTerms, cuts: Sequence[int]) -> float:
    return max(terms.term(p, lo, hi) for p, (lo, hi) in enumerate(itertools.pairwise(cuts)))


def algorithm1(terms: StageTerms) -> Partition | None:
    """Smallest bound x with a feasible partition (Alg. 1), or None if memory rules all out.

    Bisection on x between 0 and the bound of any memory-feasible partition; the
    answer is the partition found at the top of the final bracket, scored by
    its own longest operation.
    """
    if terms.depth > terms.cost.num_layers:
        return None
    first = _check(terms, INF)
    if first is None:
        return None
    (hi_cuts, greedy), lo = first, 0.0
    hi = _bound(terms, hi_cuts)
    while hi - lo > _REL_TOL * hi:
        mid = (lo + hi) / 2
        found = _check(terms, mid)
        if found is None:
            lo = mid
        else:
            (hi_cuts, greedy), hi = found, _bound(terms, found[0])
    each = tuple(terms.term(p, a, b) for p, (a, b) in enumerate(itertools.pairwise(hi_cuts)))
    return Partition(hi, hi_cuts, terms.groups, greedy, each)


@dataclass(frozen=True, slots=True)
class Grouping:
    """Algorithm 2's answer: the grouping's partition and how many groupings were tried."""

    partition: Partition
    evaluated: int


def _whole_time(cost: CostModel, group: Sequence[str], micro: int) -> float:
    """The paper's cost(V_i): the whole model on the group's summed resources."""
    if not group:
        return INF
    times = [_device_time(cost, d, 0, cost.num_layers, micro) for d in group]
    return 1 / sum(INF if t == 0 else 1 / t for t in times)


def initial_grouping(
    cost: CostModel, devices: Sequence[str], depth: int, micro: int
) -> list[list[str]]:
    """Alg. 2 lines 1-8: the slowest group takes the device that lowers its cost most.

    Empty groups are infinitely slow; ties go to the later stage (the paper
    picks arbitrarily), devices by name.
    """
    if not 1 <= depth <= len(devices):
        raise ConfigError(f"pipeline depth {depth} needs 1..{len(devices)} devices")
    groups: list[list[str]] = [[] for _ in range(depth)]
    left = sorted(devices)
    while left:
        i = max(range(depth), key=lambda i: (_whole_time(cost, groups[i], micro), i))
        pick = min(left, key=lambda d: (_whole_time(cost, [*groups[i], d], micro), d))
        groups[i].append(pick)
        left.remove(pick)
    return groups


def _neighbours(groups: list[list[str]]) -> Iterator[list[list[str]]]:
    """Moves of one device, swaps of two devices, and swaps of two stages' groups."""
    q = len(groups)
    for i, j in itertools.permutations(range(q), 2):
        if len(groups[i]) > 1:
            for d in groups[i]:
                new = [list(g) for g in groups]
                new[i].remove(d)
                new[j].append(d)
                yield new
    for i, j in itertools.combinations(range(q), 2):
        for a, b in itertools.product(groups[i], groups[j]):
            new = [list(g) for g in groups]
            new[i][new[i].index(a)], new[j][new[j].index(b)] = b, a
            yield new
        new = [list(g) for g in groups]
        new[i], new[j] = new[j], new[i]
        yield new


def _key(groups: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(sorted(g)) for g in groups)


def algorithm2(
    cost: CostModel,
    devices: Sequence[str],
    depth: int,
    micro: int,
    microbatches: int,
    start: Sequence[Sequence[str]] | None = None,
    memo: dict[tuple[tuple[str, ...], int, int, int], float] | None = None,
) -> Grouping | None:
    """Local search from `start` (default: `initial_grouping`) on Algorithm 1's bound.

    First improvement: the first neighbour with a strictly lower bound is taken
    (equal bounds compare the next-longest stage terms, which walks plateaus
    without cycling), until none is; None when no grouping visited fits in memory. `memo` shares
    stage terms between calls on the same cost model and batch geometry.
    """
    shared = {} if memo is None else memo
    seen: dict[tuple[tuple[str, ...], ...], Partition | None] = {}

    def score(groups: Sequence[Sequence[str]]) -> Partition | None:
        key = _key(groups)
        if key not in seen:
            seen[key] = algorithm1(StageTerms(cost, key, micro, microbatches, shared))
        return seen[key]

    current = [sorted(g) for g in (start or initial_grouping(cost, devices, depth, micro))]
    best = score(current)
    improved = True
    while improved:
        improved = False
        for cand in _neighbours(current):
            got = score(cand)
            if got is not None and (best is None or got.key < best.key):
                current, best, improved = [sorted(g) for g in cand], got, True
                break
    return None if best is None else Grouping(best, len(seen))


def _ordered_partitions(devices: Sequence[str], depth: int) -> Iterator[list[list[str]]]:
    """Every assignment of the devices to `depth` ordered, non-empty groups."""
    for labels in itertools.product(range(depth), repeat=len(devices)):
        if len(set(labels)) == depth:
            yield [
                [d for d, lab in zip(devices, labels, strict=True) if lab == g]
                for g in range(depth)
            ]


def brute_force_grouping(
    cost: CostModel, devices: Sequence[str], depth: int, micro: int, microbatches: int
) -> Grouping | None:
    """The best Algorithm 1 bound over every ordered grouping; for ~6 devices at most."""
    if len(devices) > 8:
        raise ConfigError(f"brute force over {len(devices)} devices is too slow; at most 8")
    best: Partition | None = None
    count = 0
    memo: dict[tuple[tuple[str, ...], int, int, int], float] = {}
    for groups in _ordered_partitions(sorted(devices), depth):
        count += 1
        got = algorithm1(StageTerms(cost, _key(groups), micro, microbatches, memo))
        if got is not None and (best is None or got.bound < best.bound):
            best = got
    return None if best is None else Grouping(best, count)


def concurrent_round(plan: Plan, cost: CostModel, beta: float | None = None) -> float:
    """Predicted round of `plan` when every device runs forward and backward concurrently.

    Each stage has a forward lane and a backward lane, each taking micro-batches
    in order; forwards last F / beta, backwards B / (1 - beta) on the slowest
    member (beta per device optimal when None), transfers queue on their link
    (one per direction per boundary, the slowest route's time), and each group
    all-reduces after its last backward. No in-flight cap: the concurrent
    schedule keeps what it needs.
    """
    s_count, m = len(plan.stages), plan.microbatches
    fwd, bwd, reduce, c_f, c_b = [], [], [], [], []
    for s, spec in enumerate(plan.stages):
        ranges = plan.ranges(s)
        fs, bs = [], []
        for d, (lo, hi) in ranges.items():
            f = cost.compute(d, spec.start, spec.end, hi - lo, "F")
            b = cost.compute(d, spec.start, spec.end, hi - lo, "B")
            x = optimal_beta(f, b) if beta is None else beta
            fs.append(split_time(f, 0.0, x))
            bs.append(split_time(0.0, b, x))
        fwd.append(max(fs))
        bwd.append(max(bs))
        reduce.append(cost.allreduce([a.device for a in spec.devices], spec.start, spec.end))
        if s + 1 < s_count:
            rs = routes(ranges, plan.ranges(s + 1))
            sizes = [(r, cost.boundary_bytes(spec.end, r.hi - r.lo)) for r in rs]
            c_f.append(max((cost.transfer(r.src, r.dst, n) for r, n in sizes), default=0.0))
            c_b.append(max((cost.transfer(r.dst, r.src, n) for r, n in sizes), default=0.0))
    f_end = [[0.0] * m for _ in range(s_count)]
    b_end = [[0.0] * m for _ in range(s_count)]
    link_f = [0.0] * s_count  # when the link after stage s is free, each direction
    link_b = [0.0] * s_count
    for j in range(m):
        for s in range(s_count):
            ready = 0.0
            if s:
                link_f[s - 1] = max(f_end[s - 1][j], link_f[s - 1]) + c_f[s - 1]
                ready = link_f[s - 1]
            f_end[s][j] = max(ready, f_end[s][j - 1] if j else 0.0) + fwd[s]
    for j in range(m):
        for s in reversed(range(s_count)):
            ready = f_end[s][j]
            if s < s_count - 1:
                link_b[s] = max(b_end[s + 1][j], link_b[s]) + c_b[s]
                ready = max(ready, link_b[s])
            b_end[s][j] = max(ready, b_end[s][j - 1] if j else 0.0) + bwd[s]
    return max(b_end[s][m - 1] + reduce[s] for s in range(s_count))


def _specs(
    cost: CostModel, part: Partition, micro: int, microbatches: int
) -> list[StageSpec] | None:
    """Integer shares for each stage's group (memory-aware `balance`), or None."""
    specs = []
    depth = len(part.groups)
    for p, ((lo, hi), group) in enumerate(zip(part.ranges, part.groups, strict=True)):
        k = _in_flight(p, depth, microbatches)
        got = balance(cost, group, lo, hi, micro, k)
        counts = got.counts if got is not None else proportional(cost, group, lo, hi, micro)
        specs.append(stage(lo, hi, group, list(counts)))
    return specs


def _round(plan: Plan, cost: CostModel) -> SimResult | None:
    """The simulated round of `plan`, or None when the runtime could not finish it."""
    try:
        return simulate(plan, cost)
    except PlanError:
        return None


def _idle_s(res: SimResult) -> float:
    """Of the round, the longest a device spends with neither lane computing."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in res.events:
        if e.kind in ("F", "B"):
            spans.setdefault(e.device, []).append((e.start, e.end))
    busy: dict[str, float] = {}
    for dev, xs in spans.items():
        total, reach = 0.0, -INF
        for start, end in sorted(xs):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        busy[dev] = total
    return max(0.0, res.round_s - max(busy.values(), default=0.0))


class DuanWuPlanner(Planner):
    """Duan & Wu (2022): Algorithm 1's partition over Algorithm 2's device groups.

    Every pipeline depth q from 1 to min(devices, layers) is grouped by
    Algorithm 2 and partitioned by Algorithm 1; each candidate's devices get
    their optimal split beta (`betas`, clipped to `BETA_RANGE`) as the
    allocation's `forward_share`, which the workers run as concurrent forward
    and backward lanes (`common.schedule.next_pair`), but only on the devices
    whose measured split gain says the device really divides (`split_reasons`;
    each device's reason is logged with the plan). Each candidate is also
    kept unsplit: under the workers' rules (K_p, a pair ends when both halves
    have) the split often loses to plain 1F1B, so the simulator decides. The
    candidates are tried in the order of their simulated round and the first
    whose plan fits every budget (`finish`, backup replicas counted) is
    returned. Its predicted round and idle time come from the simulator (the
    dominant-step estimate `finish` uses knows nothing of lanes) and its peak
    memory counts the micro-batch a splitting device adds (`split_peaks`).
    """

    name = "duanwu"

    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The fitting plan with the best simulated split round over all depths."""
        micro = micro_size(global_batch, microbatches)
        require_fits_somewhere(cost, micro)
        devs = [d.name for d in cost.cluster.devices]
        candidates: list[tuple[float, list[StageSpec]]] = []
        memo: dict[tuple[tuple[str, ...], int, int, int], float] = {}
        for depth in range(1, min(len(devs), cost.num_layers) + 1):
            got = algorithm2(cost, devs, depth, micro, microbatches, memo=memo)
            specs = None if got is None else _specs(cost, got.partition, micro, microbatches)
            if specs is None:
                continue
            raw = Plan(stages=specs, global_batch=global_batch, microbatches=microbatches)
            fitted = fit_backups(cost, raw)
            fitted = raw if fitted is None else fitted
            split = fitted.model_copy(update={"stages": split_specs(cost, fitted)})
            variants = (split, fitted) if split != fitted else (fitted,)
            for variant in variants:  # the split only where the simulator says it pays
                res = _round(variant, split_cost(cost, variant))
                candidates.append((INF if res is None else res.round_s, list(variant.stages)))
        failures: list[str] = []
        for _, specs in sorted(candidates, key=lambda c: c[0]):
            try:
                plan = finish(self.name, cost, specs, global_batch, microbatches, memory_aware=True)
            except PlanDoesNotFit as exc:
                failures.extend(exc.violations)
                continue
            res = simulate(plan, split_cost(cost, plan))
            log_split(cost, plan)
            return plan.model_copy(
                update={
                    "predicted_round_s": res.round_s,
                    "predicted_comm_s": _idle_s(res),
                    "predicted_peak_bytes": split_peaks(cost, plan),
                }
            )
        raise PlanDoesNotFit(
            f"planner {self.name} found no grouping of {len(devs)} devices whose plan fits "
            f"the budgets for a {micro}-sample micro-batch"
            + (f"; the best overshoots: {'; '.join(failures)}" if failures else ""),
            failures,
        )

    @staticmethod
    def betas(cost: CostModel, plan: Plan) -> dict[str, float]:
        """Each device's optimal forward share for its stage and samples in `plan` (unclipped)."""
        return betas(cost, plan)
