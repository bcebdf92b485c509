"""What the coordinator knows of replicas under one plan epoch, as a pure record.

Single-device stages back up to their backup node every `replicate_every`
rounds (Asteroid §3.4 (2)); backup nodes report each complete replica. The
book takes a report only when the running plan names its sender as the
stage's backup node, tells devices which versions to keep (the newest
replica of each stage and the one still on its way), and gives recovery the
replicas every device still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.ids import DeviceId
from common.messages import ReplicaSaved
from common.plan import Plan
from services.coordinator.migration import Replica

__all__ = ["REPLICAS_KEPT", "ReplicaBook"]

REPLICAS_KEPT = 2
"""Complete replicas remembered per stage: the newest, and one to fall back on."""


@dataclass(frozen=True)
class ReplicaBook:
    """Replicas of one plan epoch, and the versions devices were told to keep.

    Immutable: each update returns a new book, so the job's core stays pure.

    Attributes:
        plan: The running plan.
        epoch: Its plan epoch.
        start: Its first round: replication counts rounds from it.
        every: Rounds between replicas (0: none).

    """

    plan: Plan
    epoch: int
    start: int
    every: int
    replicas: tuple[Replica, ...] = ()
    kept: frozenset[int] = frozenset()
    """Versions every device was last told to keep, with that round's own start."""
    last: int | None = None
    """The newest version replicas were asked for."""

    def refuse(self, msg: ReplicaSaved, committed: int) -> str | None:
        """Why a replica report does not fit the running plan, or None.

        It counts only for this epoch, from the backup node of a single-device
        stage, for that stage's layers, at a version this epoch replicated.
        """
        plan = self.plan
        if msg.epoch != self.epoch:
            return f"plan epoch {msg.epoch}, current is {self.epoch}"
        if msg.origin not in plan.devices:
            return f"origin {msg.origin} is not in the plan"
        p = plan.stage_of(msg.origin)
        stage = plan.stages[p]
        if plan.backup_of(p) != msg.device:
            return f"{msg.device} is not the backup node of stage {p}"
        if (msg.start, msg.end) != (stage.start, stage.end):
            return f"layers [{msg.start}, {msg.end}) are not stage {p}'s"
        asked = (
            self.every > 0
            and self.last is not None
            and self.start <= msg.version <= min(self.last, committed)
            and (msg.version - self.start) % self.every == 0
        )
        if not asked:
            return f"version {msg.version} was not replicated in this epoch"
        return None

    def note(self, msg: ReplicaSaved, committed: int) -> tuple[ReplicaBook, str | None]:
        """The book with a report taken in, or unchanged and why not.

        Only the newest few replicas of each stage stay.
        """
        why = self.refuse(msg, committed)
        if why is not None:
            return self, why
        known = {*self.replicas, Replica(msg.origin, msg.start, msg.end, msg.version, msg.device)}
        newest: dict[DeviceId, list[Replica]] = {}
        for rep in sorted(known, key=lambda x: (-x.version, x.holder)):
            newest.setdefault(rep.origin, []).append(rep)
        kept = tuple(rep for reps in newest.values() for rep in reps[:REPLICAS_KEPT])
        return replace(self, replicas=kept), None

    def round_starts(self, r: int) -> tuple[ReplicaBook, list[int], bool]:
        """Round `r` starts: the book, the versions kept besides `r`, whether it replicates.

        The newest complete replica of each stage and the replication asked
        for last (still on its way) stay; everything older may go.
        """
        plan = self.plan
        single = any(plan.backup_of(p) is not None for p in range(len(plan.stages)))
        replicate = single and self.every > 0 and (r - self.start) % self.every == 0
        newest: dict[DeviceId, int] = {}
        for rep in self.replicas:
            newest[rep.origin] = max(rep.version, newest.get(rep.origin, -1))
        keep = set(newest.values())
        if self.last is not None:
            keep.add(self.last)
        book = replace(self, last=r if replicate else self.last, kept=frozenset({r, *keep}))
        return book, sorted(keep), replicate

    def usable(self, committed: int) -> list[Replica]:
        """Replicas every device still holds the version of: recovery may resume from them."""
        return [x for x in self.replicas if x.version in self.kept or x.version == committed]
