"""Local search on a complete plan, scored by the simulator (an Asteroid-Edge addition).

Asteroid's program ranks plans by the dominant-step estimate, which charges
every step's fill and drain on top of M times the bottleneck; the 1F1B
schedule hides part of that when the bottleneck sits early in the pipeline,
so the estimate's runner-up can run faster. This polish replays neighbours of
the chosen plan in `simulate` and keeps moving while one is faster: shift a
stage boundary or slide a middle stage by one layer, or regroup devices
(`_regroupings`: trades between stages, places inside a group, devices
joining or leaving the plan). Shares come from Algorithm 1 under each stage's
K_p and memory budgets (a backup node's replicas included); at the end the
fastest few layouts have their shares tuned by one-sample moves within each
budget (`_reshare`), so a polished plan still fits. A budget bounds the number of simulations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from common.plan import Plan
from services.planner.balance import balance, capacity, fit_backups
from services.planner.base import stage
from services.planner.cost import CostModel
from services.planner.simulator import simulate

Layout = tuple[tuple[int, int, tuple[str, ...]], ...]  # (start, end, devices) per stage
Retune = Callable[[Layout], Layout | None]  # new stage boundaries for the same groups
RESHARED = 4  # fastest layouts whose shares the polish tunes at the end


def polish(
    cost: CostModel,
    starts: Sequence[Plan],
    budget: int,
    order: Sequence[str],
    retune: Retune | None = None,
) -> tuple[Plan, float]:
    """The fastest plan reached by improving moves from any of `starts`, and its seconds.

    Each start climbs until no neighbour is faster, sharing the simulation
    budget (what a start leaves unspent goes to the next) and the set of plans
    already tried. `order` lists every device (unused ones may join) and is
    the order inside a group a device joins. With
    `retune`, every neighbour that regroups devices is also tried with the
    boundaries `retune` picks for its groups, so a regrouping that only pays
    with other boundaries is one move, not several (each of which would have
    to be faster on its own).
    """
    rank = {d: i for i, d in enumerate(order)}
    seen: set[Layout] = set()
    scored: list[tuple[float, Plan]] = []
    left = budget
    for n, start in enumerate(starts):
        share = left // (len(starts) - n)
        _, spent = _climb(cost, start, share, rank, seen, retune, scored)
        left -= spent
    if not scored:
        raise ValueError("polish needs at least one plan to start from")
    # the fastest layouts, each with its shares tuned: a layout Algorithm 1's split
    # makes second best can win once its split is tuned
    scored.sort(key=lambda x: x[0])
    tuned = [_reshare(cost, (p, t), max(1, budget // (2 * RESHARED))) for t, p in scored[:RESHARED]]
    return min(tuned, key=lambda x: x[1])


def _reshare(cost: CostModel, start: tuple[Plan, float], budget: int) -> tuple[Plan, float]:
    """Steepest descent over one-sample moves between two devices of a group.

    Algorithm 1 gives each group the split with the shortest step, which is
    not always the shortest round: which samples each member takes decides
    when downstream stages can start and when gradients return under the
    backward-first scheduler. Every move keeps each device within its budget.
    """
    (best, best_s), spent = start, 0
    while spent < budget:
        step: tuple[Plan, float] | None = None
        for trial in _share_moves(cost, best):
            if spent >= budget:
                break
            spent += 1
            score = simulate(trial, cost).round_s
            if score < best_s * (1 - 1e-9) and (step is None or score < step[1]):
                step = (trial, score)
        if step is None:
            break
        best, best_s = step
    return best, best_s


def _share_moves(cost: CostModel, plan: Plan) -> Iterator[Plan]:
    """`plan` with one sample moved from one member of a group to another that can hold it.

    A member that backs up a neighbouring stage holds its replica too.
    """
    reserved = cost.reserved(plan)
    for p, spec in enumerate(plan.stages):
        counts = [hi - lo for lo, hi in plan.ranges(p).values()]
        devs = [a.device for a in spec.devices]
        k = plan.warmup(p)
        for i, j in itertools.permutations(range(len(devs)), 2):
            held = reserved[devs[j]]
            if counts[i] <= 1 or counts[j] + 1 > capacity(
                cost, devs[j], spec.start, spec.end, k, held
            ):
                continue
            moved = list(counts)
            moved[i] -= 1
            moved[j] += 1
            stages = list(plan.stages)
            stages[p] = stage(spec.start, spec.end, devs, moved, warmup=spec.warmup)
            yield plan.model_copy(update={"stages": stages})


def _climb(
    cost: CostModel,
    plan: Plan,
    budget: int,
    rank: dict[str, int],
    seen: set[Layout],
    retune: Retune | None,
    scored: list[tuple[float, Plan]],
) -> tuple[tuple[Plan, float], int]:
    """Steepest descent from `plan`: to the fastest neighbour while it is faster.

    Steepest rather than first improvement: the first faster neighbour is
    often a one-layer shift that closes the road to a better device swap.
    """
    layout: Layout = tuple(
        (s.start, s.end, tuple(a.device for a in s.devices)) for s in plan.stages
    )
    best, best_s = plan, simulate(plan, cost).round_s
    scored.append((best_s, plan))
    seen.add(layout)
    spent = 1
    while spent < budget:
        step: tuple[Plan, float, Layout] | None = None
        for cand in _neighbours(layout, rank, retune):
            if cand in seen or spent >= budget:
                continue
            seen.add(cand)
            trial = _build(cost, cand, plan)
            if trial is None:
                continue
            spent += 1
            score = simulate(trial, cost).round_s
            scored.append((score, trial))
            if score < best_s * (1 - 1e-9) and (step is None or score < step[1]):
                step = (trial, score, cand)
        if step is None:
            break
        best, best_s, layout = step
    return (best, best_s), spent


def _neighbours(layout: Layout, rank: dict[str, int], retune: Retune | None) -> Iterator[Layout]:
    """Plans one move away: a boundary shifted, a stage slid, devices regrouped."""
    stages = list(layout)
    used = {d for _, _, devs in stages for d in devs}

    def regroup(devs: Sequence[str]) -> tuple[str, ...]:
        return tuple(sorted(devs, key=rank.__getitem__))

    for i in range(len(stages) - 1):
        (a0, a1, ad), (_, b1, bd) = stages[i], stages[i + 1]
        for cut in (a1 - 1, a1 + 1):
            if a0 < cut < b1:
                out = list(stages)
                out[i], out[i + 1] = (a0, cut, ad), (cut, b1, bd)
                yield tuple(out)
    for i in range(1, len(stages) - 1):  # slide a middle stage: both its boundaries
        (p0, _, pd), (s0, s1, sd), (_, n1, nd) = stages[i - 1], stages[i], stages[i + 1]
        for step in (-1, 1):
            if p0 < s0 + step and s1 + step < n1:
                out = list(stages)
                out[i - 1] = (p0, s0 + step, pd)
                out[i] = (s0 + step, s1 + step, sd)
                out[i + 1] = (s1 + step, n1, nd)
                yield tuple(out)
    unused = [d for d in rank if d not in used]
    for regrouped in _regroupings(stages, regroup, unused, thorough=retune is not None):
        yield regrouped
        if retune is not None:
            tuned = retune(regrouped)
            if tuned is not None and tuned != regrouped:
                yield tuned


def _regroupings(
    stages: list[tuple[int, int, tuple[str, ...]]],
    regroup: Callable[[Sequence[str]], tuple[str, ...]],
    unused: list[str],
    *,
    thorough: bool,
) -> Iterator[Layout]:
    """Devices regrouped, boundaries kept (but for a new or dropped stage).

    Two stages trade groups, two devices or one (`thorough`: any split of
    their devices between them, for small clusters); two devices of a group trade
    places (which samples each takes decides who sends to whom); an unused
    device joins a group or becomes a stage of its own (splitting a stage in
    half), and a device leaves the plan.
    """
    num = len(stages)
    for i in range(num):
        i0, i1, idevs = stages[i]
        for a in range(len(idevs)):
            for b in range(a + 1, len(idevs)):
                order = list(idevs)
                order[a], order[b] = order[b], order[a]
                yield _replace(stages, i, (i0, i1, tuple(order)))
        for d in unused:
            yield _replace(stages, i, (i0, i1, regroup([*idevs, d])))
            mid = (i0 + i1) // 2
            if i0 < mid:
                yield (*stages[:i], (i0, mid, idevs), (mid, i1, (d,)), *stages[i + 1 :])
                yield (*stages[:i], (i0, mid, (d,)), (mid, i1, idevs), *stages[i + 1 :])
        if len(idevs) > 1:
            for d in idevs:
                yield _replace(stages, i, (i0, i1, tuple(x for x in idevs if x != d)))
        elif num > 1:  # drop the stage: a neighbour takes its layers
            if i + 1 < num:
                _, n1, ndevs = stages[i + 1]
                yield (*stages[:i], (i0, n1, ndevs), *stages[i + 2 :])
            else:
                p0, _, pdevs = stages[i - 1]
                yield (*stages[: i - 1], (p0, i1, pdevs))
        for j in range(num):
            if j == i:
                continue
            j0, j1, jdevs = stages[j]
            if thorough:
                if i < j:  # every split of the two groups' devices between them
                    both = regroup([*idevs, *jdevs])
                    for mask in range(1, (1 << len(both)) - 1):
                        mine = tuple(d for k, d in enumerate(both) if mask >> k & 1)
                        rest = tuple(d for k, d in enumerate(both) if not mask >> k & 1)
                        if (set(mine), set(rest)) != (set(idevs), set(jdevs)):
                            out = list(stages)
                            out[i], out[j] = (i0, i1, mine), (j0, j1, rest)
                            yield tuple(out)
                continue
            if i < j:  # once per pair of stages
                out = list(stages)
                out[i], out[j] = (i0, i1, jdevs), (j0, j1, idevs)
                yield tuple(out)
            for d in idevs:
                if i < j and len(idevs) + len(jdevs) > 2:  # (two singletons: the trade above)
                    for e in jdevs:
                        out = list(stages)
                        out[i] = (i0, i1, regroup([x for x in idevs if x != d] + [e]))
                        out[j] = (j0, j1, regroup([x for x in jdevs if x != e] + [d]))
                        yield tuple(out)
                if len(idevs) > 1:
                    out = list(stages)
                    out[i] = (i0, i1, tuple(x for x in idevs if x != d))
                    out[j] = (j0, j1, regroup([*jdevs, d]))
                    yield tuple(out)


def _replace(
    stages: list[tuple[int, int, tuple[str, ...]]], i: int, new: tuple[int, int, tuple[str, ...]]
) -> Layout:
    return (*stages[:i], new, *stages[i + 1 :])


def _build(cost: CostModel, layout: Layout, like: Plan) -> Plan | None:
    """The plan of `layout` with Algorithm 1 shares, or None if a stage does not fit.

    Replicas count too: a group holding a neighbour's is split again around
    it (`fit_backups`), since Algorithm 1 sees one stage at a time.
    """
    specs = []
    num = len(layout)
    for p, (lo, hi, devs) in enumerate(layout):
        k = min(2 * (num - p) - 1, like.microbatches)
        got = balance(cost, devs, lo, hi, like.micro_size, k)
        if got is None:
            return None
        specs.append(stage(lo, hi, devs, got.counts))
    plan = Plan(
        stages=specs,
        global_batch=like.global_batch,
        microbatches=like.microbatches,
        planner=like.planner,
    )
    return fit_backups(cost, plan)
