"""Re-partitioning from measured speeds (FTPipeHD §III-D), as pure functions.

A device that throttles when it heats up, or a laptop that gets busy, makes the
plan's partition points wrong. Every committed round reports each device's
compute time (forward and backward); per stage, the layers' profiled cost over
that time is the group's measured speed, smoothed over rounds. Once a plan has
run `ADAPT_AFTER` rounds its speeds are the baseline. When a group's speed
drifts from it by more than `DRIFT` for `PERSIST` rounds in a row, the
partition points are moved by the measured speeds (the lightweight re-plan of a
recovery, nobody lost), and the move is made only if the predicted round
shrinks by more than `GAIN` and the time saved over the next `HORIZON` rounds
pays for the migration. A plan's first round (warm-up) is never measured. A
re-partition's baseline is the speeds it assumed, so a move made on speeds
still settling is corrected by the next one; any other new plan measures a new
baseline. So an undisturbed run never re-plans, and noise never flaps a plan.

A plan the planner made is not only re-partitioned: once moving its partition
points would be worth it, the planner plans again with each device's measured
`slowdowns` (its compute time now over its time at the baseline), so it may
regroup the devices as a fresh plan for today's speeds would; the job moves
only if that gain pays for the migration, else today's speeds are `settled`
as the baseline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from common.ids import DeviceId
from common.messages import RoundDone
from common.plan import Plan
from services.coordinator.recovery import MemoryInputs, RecoveryImpossible, survivors_plan

__all__ = [
    "ADAPT_AFTER",
    "DRIFT",
    "GAIN",
    "HORIZON",
    "PERSIST",
    "Speeds",
    "measure",
    "proposal",
    "settled",
    "slowdowns",
    "worth_moving",
]

ADAPT_AFTER = 5
"""Rounds a plan runs before its measured speeds become the baseline (warm-up included)."""
DRIFT = 0.3
"""How far (relative) a group's measured speed must move from the baseline to re-plan."""
GAIN = 0.1
"""How much (relative) a re-partition must shorten the predicted round to be made."""
HORIZON = 50
"""Rounds over which the time saved must pay for the migration."""
MIGRATION_S = 2.0
"""What a migration is assumed to cost when no re-plan of this job measured it."""
ALPHA = 0.3
"""Weight of the newest round in the smoothed speeds."""
PERSIST = 2
"""Rounds in a row a drift must last before it counts (one slow round is noise)."""


@dataclass(frozen=True)
class Speeds:
    """Each stage's measured speed under the current plan: cost units per second."""

    ema: tuple[float, ...] = ()
    base: tuple[float, ...] | None = None
    rounds: int = 0
    drifting: int = 0
    """Rounds in a row the smoothed speeds were `DRIFT` or more from the baseline."""
    last: tuple[float, ...] = ()
    """The latest round's own speeds, unsmoothed."""
    paces: Mapping[DeviceId, float] = field(default_factory=dict)
    """Each device's smoothed compute seconds per round (its own layers and samples)."""
    pace_base: Mapping[DeviceId, float] | None = None
    """The paces when the baseline was taken: the plan was made for these."""

    @property
    def slowed(self) -> bool:
        """A stage computes `DRIFT` or more below its baseline, smoothed or in the latest round.

        The latest round's own speeds show a sudden slowdown the smoothed ones
        show only rounds later: enough to explain why peers waited longer, not
        to re-partition on. Faster compute explains no longer wait.
        """
        if self.base is None or min(self.base, default=0.0) <= 0:
            return False
        return any(
            len(speeds) == len(self.base)
            and any(s <= (1.0 - DRIFT) * b for s, b in zip(speeds, self.base, strict=True))
            for speeds in (self.ema, self.last)
        )

    @classmethod
    def assumed(cls, speeds: Sequence[float]) -> Speeds:
        """A re-partitioned plan's start: the speeds it was made for are its baseline."""
        return cls(ema=tuple(speeds), base=tuple(speeds), rounds=ADAPT_AFTER)


def _drift(ema: Sequence[float], base: Sequence[float]) -> float:
    """The largest relative move of a stage's speed from its baseline."""
    if len(ema) != len(base) or min(base, default=0.0) <= 0:
        return 0.0
    return max(abs(e / b - 1.0) for e, b in zip(ema, base, strict=True))


def _work(costs: Sequence[float], start: int, end: int) -> float:
    return float(sum(costs[start:end]))


def measure(
    speeds: Speeds, plan: Plan, costs: Sequence[float], done: Mapping[DeviceId, RoundDone]
) -> Speeds:
    """The speeds after one more committed round of `plan`.

    A stage's time is its slowest device's forward and backward compute (waits
    for peers are the other stages' doing, not its own). The first round of a
    plan warms caches and allocators up: it is counted, not measured.
    """
    if speeds.rounds == 0 and not speeds.ema:
        return Speeds(rounds=1)
    now: list[float] = []
    last: list[float] = []
    for p, stage in enumerate(plan.stages):
        times = [done[a.device].timings for a in stage.devices if a.device in done]
        t = max((x.forward_s + x.backward_s for x in times), default=0.0)
        work = _work(costs, stage.start, stage.end)
        old = speeds.ema[p] if p < len(speeds.ema) else None
        if t <= 0 or work <= 0:  # nothing measured: keep what was known
            now.append(old if old is not None else 0.0)
            last.append(now[-1])
            continue
        fresh = work / t
        last.append(fresh)
        now.append(fresh if old is None or old <= 0 else ALPHA * fresh + (1 - ALPHA) * old)
    rounds = speeds.rounds + 1
    base = tuple(now) if rounds == ADAPT_AFTER else speeds.base
    drifting = speeds.drifting + 1 if base and _drift(now, base) >= DRIFT else 0
    paces = dict(speeds.paces)
    for device, m in done.items():
        t = m.timings.forward_s + m.timings.backward_s
        if t > 0:
            old_t = paces.get(device)
            paces[device] = t if old_t is None else ALPHA * t + (1 - ALPHA) * old_t
    pace_base = dict(paces) if rounds == ADAPT_AFTER else speeds.pace_base
    return Speeds(
        ema=tuple(now),
        base=base,
        rounds=rounds,
        drifting=drifting,
        last=tuple(last),
        paces=paces,
        pace_base=pace_base,
    )


def slowdowns(speeds: Speeds) -> dict[DeviceId, float]:
    """How many times slower each device computes now than when the plan's baseline was taken.

    The planner multiplies a device's profiled times by its slowdown, so a plan
    made with these fits the devices as they are now (a throttled Jetson, a busy
    laptop), not as they were profiled. Per device, not per stage: in a
    data-parallel group only the device that slowed down is slower.
    """
    if speeds.pace_base is None:
        return {}
    return {
        d: speeds.paces[d] / base
        for d, base in speeds.pace_base.items()
        if base > 0 and speeds.paces.get(d, 0.0) > 0
    }


def settled(speeds: Speeds) -> Speeds:
    """The speeds after a re-plan was considered and not made: today's are the new baseline.

    Today's are the latest round's own, not the smoothed ones still on their way
    to them (which would drift again from a baseline they have not reached).
    The paces' baseline stays the plan's own (what the plan was made for), so a
    later re-plan still sees the whole slowdown since.
    """
    now = speeds.last if len(speeds.last) == len(speeds.ema) else speeds.ema
    return replace(speeds, ema=now, base=now, drifting=0)


def _round_s(plan: Plan, costs: Sequence[float], ema: Sequence[float]) -> float:
    """The slowest stage's predicted compute time under `plan` at speeds `ema` (by group)."""
    return max(
        _work(costs, st.start, st.end) / ema[p] if ema[p] > 0 else float("inf")
        for p, st in enumerate(plan.stages)
    )


def worth_moving(now_s: float, then_s: float, remaining: int, migration_s: float | None) -> bool:
    """A new plan predicting `then_s` per round is worth leaving one predicting `now_s` for.

    It must save more than `GAIN` of the round, and the time saved over the next
    rounds (at most `HORIZON`) must pay for the migration (`migration_s`, what the
    job's last re-plan took, else `MIGRATION_S`).
    """
    saved = now_s - then_s
    return saved >= GAIN * now_s and saved * min(remaining, HORIZON) >= (migration_s or MIGRATION_S)


def proposal(
    speeds: Speeds,
    plan: Plan,
    costs: Sequence[float],
    remaining: int,
    migration_s: float | None = None,
    memory: MemoryInputs | None = None,
) -> tuple[Plan, str] | None:
    """The plan re-partitioned by measured speeds and why, or None when it is not worth it.

    Args:
        speeds: The current plan's measured speeds.
        plan: The running plan.
        costs: Per-layer costs (profiled) the speeds are measured in.
        remaining: Rounds left in the job.
        migration_s: What a re-plan of this job took last time, if one did.
        memory: The model's bytes and the devices' budgets: only a split that
            fits them is proposed.

    """
    if speeds.base is None or speeds.drifting < PERSIST or remaining <= 0:
        return None
    if len(speeds.ema) != len(plan.stages) or min(speeds.ema) <= 0:
        return None
    drift = _drift(speeds.ema, speeds.base)
    by_device = {
        a.device: speeds.ema[p] / len(st.devices)
        for p, st in enumerate(plan.stages)
        for a in st.devices
    }
    try:
        moved = survivors_plan(plan, set(), costs, by_device, memory)
    except RecoveryImpossible:
        return None
    now_s, then_s = _round_s(plan, costs, speeds.ema), _round_s(moved, costs, speeds.ema)
    if not worth_moving(now_s, then_s, remaining, migration_s):
        return None
    why = (
        f"measured speeds moved {drift:.0%} from the plan's first rounds: "
        f"slowest stage {now_s:.3f} s -> {then_s:.3f} s per round"
    )
    return moved.model_copy(update={"planner": f"{plan.planner}+measured"}), why
