"""Min-max contiguous partition of layers, shared by the baseline planners.

Several baselines split layers into a fixed number of stages so that the
slowest stage is as fast as possible, each under its own stage-cost model.
Bisection on the target time with a greedy sweep is exact up to the
bisection tolerance whenever a stage's cost grows with its range, and costs
O(L log) evaluations instead of the O(L^2 S) of the textbook program.
"""

from __future__ import annotations

from collections.abc import Callable

StageCost = Callable[[int, int, int], float]  # (stage index, start, end) -> seconds


def minmax_cuts(layers: int, parts: int, stage_cost: StageCost, rounds: int = 60) -> list[int]:
    """Boundaries [0, c_1, ..., layers] of `parts` non-empty stages minimising the max cost.

    `parts` must not exceed `layers`.
    """
    hi = max(stage_cost(s, 0, layers) for s in range(parts))
    lo = 0.0
    best = _greedy(layers, parts, stage_cost, hi)
    if best is None:  # pragma: no cover - one stage holding everything is always under hi
        raise AssertionError("greedy failed at the trivial bound")
    for _ in range(rounds):
        mid = (lo + hi) / 2
        got = _greedy(layers, parts, stage_cost, mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return _fill(best, parts, stage_cost)


def _greedy(layers: int, parts: int, stage_cost: StageCost, target: float) -> list[int] | None:
    """Stages as long as possible under `target`; None if `parts` stages do not suffice."""
    cuts, start = [0], 0
    for s in range(parts):
        end = start
        while end < layers and stage_cost(s, start, end + 1) <= target:
            end += 1
        if end == start:
            return None
        cuts.append(end)
        start = end
        if end == layers:
            return cuts
    return None


def _fill(cuts: list[int], parts: int, stage_cost: StageCost) -> list[int]:
    """Split the costliest stages in half until there are exactly `parts`.

    Only reached when fewer stages already meet the target; a split stage gets
    cheaper, though later stages shift to the next index's cost model.
    """
    cuts = list(cuts)
    while len(cuts) - 1 < parts:
        spans = [
            (stage_cost(i, cuts[i], cuts[i + 1]), i)
            for i in range(len(cuts) - 1)
            if cuts[i + 1] - cuts[i] > 1
        ]
        _, i = max(spans)
        cuts.insert(i + 1, (cuts[i] + cuts[i + 1]) // 2)
    return cuts
