"""Grouping homes for hierarchical FL: FedAT's, Astraea's and Eco-FL's, and Algorithm 1.

Definitions (all pure, on plain numbers):

- Data gap of a set of homes: the L1 distance between the normalised sum of their label
  histograms and the federation's (all homes'). L1 rather than KL because it stays finite
  when a group lacks a class and lies in [0, 2], so it adds to the latency term.
- Latency spread: (max - min) of the members' latencies over the mean latency of all
  homes, so it is unit-free.
- ``COST`` of a group = data gap + ``latency_weight`` * latency spread (Eco-FL's joint
  target); ``COST^g_n`` is the cost group g would have with home n in it.
- ``L^g``: the mean latest latency of g's members (n itself excluded when n is one).
- ``RT^g = rt_fraction * L^g``: a relative band, so slow groups tolerate proportionally
  larger drifts and a group of identical homes still has a non-zero band.
- A home's latency here is its judged one: the median of its last ``window``
  measurements, and a change of group waits for ``dwell`` consecutive measurements
  that call for it (`services.federation.band`; both 1 is Algorithm 1 as published).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from common.errors import ConfigError
from services.federation.band import check_band, median, pushed

__all__ = [
    "GroupState",
    "Groups",
    "Regrouped",
    "astraea_groups",
    "data_gap",
    "fedat_groups",
    "group_cost",
    "group_homes",
    "group_latency",
    "join_cost",
    "out_of_band",
    "record",
    "regroup",
]

Groups = tuple[tuple[int, ...], ...]
"""Group ``g``'s home ids, sorted; every home is in at most one group."""

_EPS = 1e-12


def data_gap(histogram: Sequence[float], target: Sequence[float]) -> float:
    """L1 distance between two label distributions given as (unnormalised) counts.

    Raises:
        ConfigError: Lengths differ, or a histogram has no samples.

    """
    if len(histogram) != len(target):
        raise ConfigError(
            f"histograms need equal class counts, got {len(histogram)}, {len(target)}"
        )
    total, ref = float(sum(histogram)), float(sum(target))
    if total <= 0 or ref <= 0:
        raise ConfigError(f"histograms need samples, got totals {total} and {ref}")
    return sum(abs(h / total - t / ref) for h, t in zip(histogram, target, strict=True))


def _summed(members: Sequence[int], histograms: Sequence[Sequence[float]]) -> list[float]:
    return [float(sum(col)) for col in zip(*(histograms[m] for m in members), strict=True)]


def group_cost(
    members: Sequence[int],
    latencies: Sequence[float],
    histograms: Sequence[Sequence[float]],
    latency_weight: float = 1.0,
) -> float:
    """Eco-FL's joint target for one group: data gap plus weighted latency spread."""
    if not members:
        raise ConfigError("the cost of a group needs at least one member, got none")
    gap = data_gap(_summed(members, histograms), _summed(range(len(histograms)), histograms))
    spread = max(latencies[m] for m in members) - min(latencies[m] for m in members)
    return gap + latency_weight * spread / (sum(latencies) / len(latencies))


def out_of_band(members: Sequence[int], latencies: Sequence[float], rt_fraction: float) -> int:
    """How many members lie outside their group's band: ``|L^g - L_n| > RT^g``.

    ``L^g`` excludes the member itself, as in `regroup`; a lone member is always inside.
    """
    count = 0
    for n in members:
        others = [latencies[m] for m in members if m != n]
        if others:
            ref = sum(others) / len(others)
            count += abs(ref - latencies[n]) > rt_fraction * ref
    return count


def _check(latencies: Sequence[float], histograms: Sequence[Sequence[float]], groups: int) -> None:
    n = len(latencies)
    if len(histograms) != n:
        raise ConfigError(f"need one histogram per home ({n}), got {len(histograms)}")
    if not 1 <= groups <= n:
        raise ConfigError(f"groups must be in [1, {n}] for {n} homes, got {groups}")
    if any(not lat > 0 for lat in latencies):
        raise ConfigError(f"latencies must be > 0, got {list(latencies)}")


def _sizes(n: int, groups: int) -> list[int]:
    return [n // groups + (1 if g < n % groups else 0) for g in range(groups)]


def fedat_groups(latencies: Sequence[float], groups: int) -> Groups:
    """FedAT's tiers: homes sorted by latency (ties by id), cut into near-equal runs."""
    _check(latencies, [[1.0]] * len(latencies), groups)
    order = sorted(range(len(latencies)), key=lambda h: (latencies[h], h))
    out: list[tuple[int, ...]] = []
    start = 0
    for size in _sizes(len(order), groups):
        out.append(tuple(sorted(order[start : start + size])))
        start += size
    return tuple(out)


def astraea_groups(histograms: Sequence[Sequence[float]], groups: int) -> Groups:
    """Astraea's data-only grouping: fill groups one by one, greedily closest to global.

    Each step adds the remaining home that brings the group's label distribution
    nearest (L1) to the federation's; ties go to the lowest id. Latency is ignored.
    """
    _check([1.0] * len(histograms), histograms, groups)
    target = _summed(range(len(histograms)), histograms)
    left = list(range(len(histograms)))
    out: list[tuple[int, ...]] = []
    for size in _sizes(len(histograms), groups):
        members: list[int] = []
        for _ in range(size):
            best = min(
                left, key=lambda h: (data_gap(_summed([*members, h], histograms), target), h)
            )
            members.append(best)
            left.remove(best)
        out.append(tuple(sorted(members)))
    return tuple(out)


def group_homes(
    latencies: Sequence[float],
    histograms: Sequence[Sequence[float]],
    groups: int,
    latency_weight: float = 1.0,
    rt_fraction: float | None = None,
) -> Groups:
    """Eco-FL's joint grouping: FedAT's latency tiers, refined by swaps toward IID data.

    Starting from the tiers, the swap of two homes between two groups that lowers the
    summed `group_cost` most is applied until none lowers it (a local optimum; group
    sizes stay as the tiers had them). ``latency_weight`` 0 gives a data-only target.
    With ``rt_fraction`` (the regrouping band ``RT^g``), a swap must not leave more
    homes outside their group's band than before: a grouping that Algorithm 1 would
    undo at the first measured latency is no grouping to start from.
    """
    _check(latencies, histograms, groups)
    current = [list(g) for g in fedat_groups(latencies, groups)]

    def cost(members: Sequence[int]) -> float:
        return group_cost(members, latencies, histograms, latency_weight)

    def outside(members: Sequence[int]) -> int:
        return 0 if rt_fraction is None else out_of_band(members, latencies, rt_fraction)

    for _ in range(len(latencies) ** 2):  # each swap lowers the cost; this bounds the loop
        best: tuple[float, int, int, int, int] | None = None
        for a in range(groups):
            for b in range(a + 1, groups):
                before = cost(current[a]) + cost(current[b])
                strays = outside(current[a]) + outside(current[b])
                for i in current[a]:
                    for j in current[b]:
                        ga = [j if m == i else m for m in current[a]]
                        gb = [i if m == j else m for m in current[b]]
                        if outside(ga) + outside(gb) > strays:
                            continue
                        delta = cost(ga) + cost(gb) - before
                        if delta < -_EPS and (best is None or delta < best[0] - _EPS):
                            best = (delta, a, b, i, j)
        if best is None:
            break
        _, a, b, i, j = best
        current[a] = [j if m == i else m for m in current[a]]
        current[b] = [i if m == j else m for m in current[b]]
    return tuple(tuple(sorted(g)) for g in current)


@dataclass(frozen=True)
class GroupState:
    """What the server knows for regrouping: groups, latest latencies, histograms.

    Attributes:
        groups: Current groups; a group may become empty when its homes leave.
        latencies: Judged response latency of each home, by id: the median of
            ``recent`` (the latest measurement when ``window`` is 1).
        histograms: Each home's label histogram (counts), by id.
        dropped: Homes sitting out until their latency fits some group.
        rt_fraction: ``RT^g = rt_fraction * L^g``.
        latency_weight: Weight of the latency spread in ``COST``.
        window: Measurements a home's judged latency is the median of.
        dwell: Consecutive measurements calling for a change of group before it is made.
        recent: Each home's last ``window`` measured latencies, by id (empty: each
            home's ``latencies`` entry ``window`` times, so that a median is always
            over ``window`` values and the first rounds are judged like the later).
        strikes: Each home's consecutive measurements so far that called for a
            change of group, by id (empty: none).

    """

    groups: Groups
    latencies: tuple[float, ...]
    histograms: tuple[tuple[float, ...], ...]
    dropped: frozenset[int] = frozenset()
    rt_fraction: float = 0.5
    latency_weight: float = 1.0
    window: int = 1
    dwell: int = 1
    recent: tuple[tuple[float, ...], ...] = ()
    strikes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.latencies)
        _check(self.latencies, self.histograms, 1)
        check_band(self.window, self.dwell)
        if not self.recent:
            filled = tuple((lat,) * self.window for lat in self.latencies)
            object.__setattr__(self, "recent", filled)
        if not self.strikes:
            object.__setattr__(self, "strikes", (0,) * n)
        if len(self.recent) != n or len(self.strikes) != n:
            raise ConfigError(
                f"need recent latencies and strikes for each of {n} homes, got "
                f"{len(self.recent)} and {len(self.strikes)}"
            )
        if any(not 1 <= len(r) <= self.window or any(not x > 0 for x in r) for r in self.recent):
            raise ConfigError(
                f"need 1..{self.window} recent latencies > 0 per home, got {self.recent}"
            )
        if any(not 0 <= k < self.dwell for k in self.strikes):
            raise ConfigError(f"strikes must be in [0, {self.dwell}), got {self.strikes}")
        placed = [h for g in self.groups for h in g] + sorted(self.dropped)
        if sorted(placed) != list(range(n)):
            raise ConfigError(
                f"every home 0..{n - 1} must be in exactly one group or dropped, got "
                f"groups {self.groups} and dropped {sorted(self.dropped)}"
            )
        if not self.rt_fraction > 0 or self.latency_weight < 0:
            raise ConfigError(
                f"need rt_fraction > 0 and latency_weight >= 0, got "
                f"{self.rt_fraction} and {self.latency_weight}"
            )

    def group_of(self, home: int) -> int | None:
        """Index of the home's group, or None while it is dropped."""
        return next((g for g, members in enumerate(self.groups) if home in members), None)


def group_latency(state: GroupState, group: int, exclude: int | None = None) -> float | None:
    """``L^g``: mean latest latency of the group's members but ``exclude``; None if none."""
    members = [m for m in state.groups[group] if m != exclude]
    if not members:
        return None
    return sum(state.latencies[m] for m in members) / len(members)


def join_cost(state: GroupState, group: int, home: int) -> float:
    """``COST^g_n``: the cost group ``g`` would have with home ``n`` in it."""
    members = sorted({*state.groups[group], home})
    return group_cost(members, state.latencies, state.histograms, state.latency_weight)


@dataclass(frozen=True)
class Regrouped:
    """Outcome of one `regroup` call.

    Attributes:
        state: The new state (latency recorded, membership changed if any).
        action: ``stay`` (fits its group), ``move`` (to ``group``), ``drop`` (fits
            none), ``rejoin`` (a dropped home fits ``group``), ``out`` (still fits none).
        group: The home's group afterwards, None when dropped.

    """

    state: GroupState
    action: Literal["stay", "move", "drop", "rejoin", "out"]
    group: int | None


def record(state: GroupState, home: int, latency: float) -> GroupState:
    """The state with ``latency`` measured for ``home``: its judged latency re-taken.

    Raises:
        ConfigError: Unknown home or a latency that is not > 0.

    """
    if not 0 <= home < len(state.latencies):
        raise ConfigError(f"home must be in [0, {len(state.latencies)}), got {home}")
    if not latency > 0:
        raise ConfigError(f"home {home}: latency must be > 0, got {latency}")
    recent = list(state.recent)
    recent[home] = pushed(recent[home], float(latency), state.window)
    lats = list(state.latencies)
    lats[home] = median(recent[home])
    return replace(state, latencies=tuple(lats), recent=tuple(recent))


def _struck(state: GroupState, home: int, strikes: int) -> GroupState:
    counts = list(state.strikes)
    counts[home] = strikes
    return replace(state, strikes=tuple(counts))


def regroup(state: GroupState, home: int, latency: float) -> Regrouped:
    """Algorithm 1 for one measured latency ``L_n`` of home ``n``.

    If ``|L^g - L_n| > RT^g`` for its group g, n moves to the group of minimum
    ``COST^g_n`` among those with ``|L^g - L_n| < RT^g`` (ties: lowest index; empty
    groups have no ``L^g`` and are skipped), or drops out; a dropped home rejoins the
    same way once some group's band holds its latency. ``L_n`` is the home's judged
    latency (see `record`), and a change is made only on the ``dwell``-th consecutive
    measurement that calls for one; before that the home keeps its place (``stay``
    or ``out``) with the count noted.

    Raises:
        ConfigError: Unknown home or a latency that is not > 0.

    """
    st = record(state, home, latency)
    judged = st.latencies[home]
    current = st.group_of(home)
    if current is not None:
        ref = group_latency(st, current, exclude=home)
        if ref is None or abs(ref - judged) <= st.rt_fraction * ref:
            return Regrouped(_struck(st, home, 0), "stay", current)
    target, min_cost = -1, float("inf")
    for g in range(len(st.groups)):
        ref = group_latency(st, g, exclude=home)
        if ref is None or not abs(ref - judged) < st.rt_fraction * ref:
            continue
        cost = join_cost(st, g, home)
        if cost < min_cost:
            target, min_cost = g, cost
    if current is None and target == -1:
        return Regrouped(_struck(st, home, 0), "out", None)
    if st.strikes[home] + 1 < st.dwell:
        held = _struck(st, home, st.strikes[home] + 1)
        return Regrouped(held, "stay" if current is not None else "out", current)
    st = _struck(st, home, 0)
    without = tuple(tuple(m for m in members if m != home) for members in st.groups)
    if target == -1:
        new = replace(st, groups=without, dropped=st.dropped | {home})
        return Regrouped(new, "drop", None)
    groups = tuple(
        tuple(sorted((*members, home))) if g == target else members
        for g, members in enumerate(without)
    )
    new = replace(st, groups=groups, dropped=st.dropped - {home})
    return Regrouped(new, "move" if current is not None else "rejoin", target)
