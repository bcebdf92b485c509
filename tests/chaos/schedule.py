"""A seeded chaos schedule: which membership events, in which order, on whom.

Pure: the same seed, backend kinds and cluster size give the same schedule.
Drawn so that the job can always go on:

- never fewer live devices than the job needs, counting each event's worst
  case (a hang or a cut that outlasts detection is a loss; see
  `backend.REMOVING`); when a removal would go below, a device joins first;
- a hang and a cut are one event each (stop then cont, cut then restore after
  the hold), so none is left un-done;
- a `second_kill` directly follows a `kill` or `kill_stage`: the runner
  injects it once that first failure is being recovered, before it is over;
- coordinator and Redis restarts are spaced (`space` events between two) and
  never follow a failure directly, so each finds a job that commits again.

Targets are drawn as numbers (`pick`) that the runner maps onto the devices
live at injection time (sorted names, `pick % n`; for `kill_stage` the stage
index): which devices are live then depends on what recovery chose, which a
pure schedule cannot know, and the mapping keeps a run reproducible from its
seed all the same.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from tests.chaos.backend import CONTROL_PLANE, KINDS, REMOVING, Kind

FAILURES: frozenset[Kind] = frozenset({"kill", "kill_stage"})
PICK_RANGE = 1 << 16


@dataclass(frozen=True)
class Event:
    """One scheduled event.

    `gap_rounds`: rounds the job commits after it is back from the previous
    event before this one is injected (a `second_kill` ignores it: it waits for
    the previous failure's `recovering`). `hold_s`: how long a hang or a cut
    lasts. `new_device`: the name a `join` starts.
    """

    index: int
    kind: Kind
    pick: int
    gap_rounds: int
    hold_s: float = 0.0
    new_device: str = ""

    def describe(self) -> str:
        extra = f" hold {self.hold_s:.1f} s" if self.hold_s else ""
        extra += f" as {self.new_device}" if self.new_device else ""
        after = f"after {self.gap_rounds} rounds"
        return f"#{self.index} {self.kind} (pick {self.pick}, {after}{extra})"


@dataclass(frozen=True)
class Schedule:
    seed: int
    events: tuple[Event, ...]
    initial_devices: int
    need: int

    def rounds_needed(self, per_event: int = 10) -> int:
        """Rounds the job should have so that every event finds it running.

        Each event's gap, plus `per_event` for the rounds that pass while it
        lasts (a hang held, a join profiled and planned: the job goes on
        meanwhile) and what a recovery replays, plus a tail after the last one.
        """
        return sum(e.gap_rounds + per_event for e in self.events) + 2 * per_event

    def live_after(self) -> list[int]:
        """The worst-case live device count after each event."""
        live, out = self.initial_devices, []
        for event in self.events:
            live += 1 if event.kind == "join" else -REMOVING.get(event.kind, 0)
            out.append(live)
        return out


def _allowed(
    kind: Kind, previous: list[Event], live: int, need: int, space: int, max_devices: int
) -> bool:
    if kind == "join":
        return live < max_devices
    if live - REMOVING.get(kind, 0) < need:
        return False
    last = previous[-1].kind if previous else None
    if kind == "second_kill":
        return last in FAILURES
    if kind in CONTROL_PLANE:
        if last in FAILURES or not previous:
            return False
        since = [i for i, e in enumerate(previous) if e.kind in CONTROL_PLANE]
        return not since or len(previous) - since[-1] > space
    return True


def _choose(rng: random.Random, ok: list[Kind], pending: list[Kind], live: int, need: int) -> Kind:
    """The next kind: a pending `second_kill` first, then the pending kinds in order, then any.

    A failure is only chosen for a pending kind while a `second_kill` could
    still follow it; when room is short, joins are drawn more often.
    """
    if "second_kill" in ok and "second_kill" in pending:
        return "second_kill"  # while the failure before it is still recovering
    for kind in pending:
        if kind == "second_kill":
            continue
        if kind in FAILURES and "second_kill" in pending and live - REMOVING[kind] - 1 < need:
            continue
        if kind in ok:
            return kind
    weights = [3.0 if k == "join" and live - need < 2 else 1.0 for k in ok]
    return rng.choices(ok, weights)[0]


def draw(
    seed: int,
    events: int,
    kinds: Iterable[Kind],
    *,
    initial_devices: int,
    need: int,
    max_devices: int | None = None,
    space: int = 2,
    gap_rounds: tuple[int, int] = (1, 3),
    hold_s: tuple[float, float] = (0.5, 4.0),
) -> Schedule:
    """A schedule of `events` events of the given `kinds`, each kind at least once if room.

    Raises ValueError when the constraints leave nothing to draw (too few
    devices and no `join` to add one).
    """
    supported = [k for k in KINDS if k in set(kinds)]
    if not supported:
        raise ValueError("no event kinds to draw from")
    if initial_devices < need:
        raise ValueError(f"{initial_devices} devices, the job needs {need}")
    cap = max_devices if max_devices is not None else initial_devices + 2
    rng = random.Random(seed)
    pending = list(supported)
    rng.shuffle(pending)  # every kind once first (when it fits), in a seeded order
    out: list[Event] = []
    live, joined = initial_devices, 0
    while len(out) < events:
        ok = [k for k in supported if _allowed(k, out, live, need, space, cap)]
        if not ok:
            raise ValueError(f"nothing can be drawn after {[e.kind for e in out]} ({live} live)")
        kind = _choose(rng, ok, pending, live, need)
        if kind in pending:
            pending.remove(kind)
        hold = round(rng.uniform(*hold_s), 1) if kind in ("stop_cont", "cut_restore") else 0.0
        name = ""
        if kind == "join":
            joined += 1
            name = f"j{joined}"
        out.append(
            Event(
                index=len(out),
                kind=kind,
                pick=rng.randrange(PICK_RANGE),
                gap_rounds=rng.randint(*gap_rounds),
                hold_s=hold,
                new_device=name,
            )
        )
        live += 1 if kind == "join" else -REMOVING.get(kind, 0)
    return Schedule(seed, tuple(out), initial_devices, need)


def check(schedule: Schedule, space: int = 2) -> list[str]:
    """Every constraint a schedule breaks, as readable lines ([] if none): for tests and tools."""
    problems = []
    for event, live in zip(schedule.events, schedule.live_after(), strict=True):
        if live < schedule.need:
            problems.append(f"{event.describe()}: {live} live, the job needs {schedule.need}")
    kinds: list[Kind | None] = [None, *(e.kind for e in schedule.events)]
    for before, event in zip(kinds, schedule.events, strict=False):
        if event.kind == "second_kill" and before not in FAILURES:
            problems.append(f"{event.describe()} does not follow a failure")
        if event.kind in CONTROL_PLANE and before in FAILURES:
            problems.append(f"{event.describe()} directly follows a failure")
    restarts = [e.index for e in schedule.events if e.kind in CONTROL_PLANE]
    for a, b in itertools.pairwise(restarts):
        if b - a <= space:
            problems.append(f"restarts #{a} and #{b} are closer than {space} events apart")
    for event in schedule.events:
        if event.kind in ("stop_cont", "cut_restore") and event.hold_s <= 0:
            problems.append(f"{event.describe()} has no hold")
    return problems
