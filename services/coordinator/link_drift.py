"""When to measure the links again: communication slower than planned, compute not.

A plan's predicted communication rests on the link matrix measured before it.
If, round after round, the devices report far more time communicating (their
`StageTimings.wait_s` plus `allreduce_s`) than the plan predicted for it while
their compute speeds hold (no stage of `adapt.Speeds` slowed down, so a slow
device does not explain it), the links changed: the coordinator measures them again at the
next round boundary and re-plans only if the new matrix predicts a gain worth
the migration (`adapt.worth_moving`). A re-measurement is followed by a
cool-down, so a link that stays slow (and a plan that already fits it) never
makes the coordinator measure or re-plan over and over.

Pure functions of the job's state; the job core calls them once per committed round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.ids import DeviceId
from common.messages import RoundDone
from services.coordinator.adapt import PERSIST, Speeds, worth_moving

__all__ = [
    "COOLDOWN",
    "FLOOR_S",
    "SLOWER",
    "CommWatch",
    "comm_s",
    "compute_ratio",
    "observe",
    "remeasured",
    "replan_worth_it",
]

SLOWER = 2.0
"""How many times its predicted communication a round must take to count as slow."""
FLOOR_S = 0.05
"""Seconds of communication below which nothing counts as slow (timer noise)."""
COOLDOWN = 20
"""Rounds after a re-measurement before slow rounds count again."""


@dataclass(frozen=True)
class CommWatch:
    """Slow rounds in a row, and rounds left in the cool-down after a re-measurement."""

    slow: int = 0
    cooldown: int = 0

    @property
    def due(self) -> bool:
        """The links should be measured again at the next round boundary."""
        return self.cooldown == 0 and self.slow >= PERSIST


def comm_s(done: Mapping[DeviceId, RoundDone]) -> float:
    """A round's communication time: its most communicating device's waits and all-reduce."""
    return max((m.timings.wait_s + m.timings.allreduce_s for m in done.values()), default=0.0)


def compute_ratio(done: Mapping[DeviceId, RoundDone], predicted_s: float) -> float:
    """How much slower than predicted (`predicted_s`, the least busy device's) compute ran.

    1 when unknown or faster. A worker's waits include the pipeline's bubbles,
    which last as long as its peers' compute: when every device computes k
    times slower than profiled, they wait k times longer without any link
    being to blame.
    """
    took = min((m.timings.forward_s + m.timings.backward_s for m in done.values()), default=0.0)
    return max(1.0, took / predicted_s) if predicted_s > 0 else 1.0


def observe(
    watch: CommWatch,
    predicted_s: float,
    done: Mapping[DeviceId, RoundDone],
    speeds: Speeds,
    compute_s: float = 0.0,
) -> CommWatch:
    """The watch after one more committed round whose communication was predicted `predicted_s`.

    With `compute_s` (the plan's predicted compute of its least busy device),
    the prediction is scaled by how much slower the devices really compute
    (`compute_ratio`), so only what compute cannot explain counts.

    A round counts as slow when it communicated more than `SLOWER` times the
    prediction (and more than `FLOOR_S` beyond it) while no stage's compute
    slowed down, smoothed or in this very round (a stage that slows down
    makes its peers wait at once, before the smoothed speeds show it); any
    other round resets the count.
    """
    if watch.cooldown > 0:
        return CommWatch(cooldown=watch.cooldown - 1)
    if predicted_s <= 0 or speeds.slowed:  # nothing to compare, or compute explains it
        return CommWatch()
    expected = predicted_s * compute_ratio(done, compute_s)
    took = comm_s(done)
    slow = took > SLOWER * expected and took - expected > FLOOR_S
    return CommWatch(slow=watch.slow + 1 if slow else 0)


def remeasured() -> CommWatch:
    """The watch once the links were measured again: cooling down, whatever the outcome."""
    return CommWatch(cooldown=COOLDOWN)


def replan_worth_it(
    current_s: float, proposed_s: float, remaining: int, migration_s: float | None
) -> bool:
    """Re-plan on the new matrix only if, under it, the new plan beats the running one.

    Both predictions are made with the newly measured links (`current_s`: the
    running plan's round, `proposed_s`: the new plan's), by the same rules as
    a re-partition by measured speeds.
    """
    return worth_moving(current_s, proposed_s, remaining, migration_s)
