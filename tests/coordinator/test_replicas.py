"""The coordinator's record of replicas: which reports count, what devices keep, what is usable."""

from __future__ import annotations

import pytest

from common.ids import DeviceId
from common.messages import ReplicaSaved
from services.coordinator.migration import Replica
from services.coordinator.replicas import ReplicaBook
from tests.coordinator.test_migration import plan_of

# [a] [b] [c, d]: a backs up to b, b to c; the group [c, d] backs up nowhere
PLAN = plan_of((0, 2, ["a"]), (2, 4, ["b"]), (4, 7, ["c", "d"]))


def saved(holder: str, origin: str, version: int, epoch: int = 5, span=(0, 2)) -> ReplicaSaved:
    return ReplicaSaved(
        device=DeviceId(holder),
        epoch=epoch,
        version=version,
        origin=DeviceId(origin),
        start=span[0],
        end=span[1],
    )


def book(every: int = 2, start: int = 10) -> ReplicaBook:
    return ReplicaBook(PLAN, epoch=5, start=start, every=every)


class Book:
    """A mutable holder, so the scripted steps below read in order."""

    def __init__(self, b: ReplicaBook) -> None:
        self.b = b

    def round_starts(self, r: int) -> tuple[list[int], bool]:
        self.b, keep, replicate = self.b.round_starts(r)
        return keep, replicate

    def note(self, msg: ReplicaSaved, committed: int) -> str | None:
        self.b, why = self.b.note(msg, committed)
        return why


def test_replication_runs_every_few_rounds_of_the_epoch_and_keeps_what_may_be_needed() -> None:
    b = Book(book(every=2, start=10))
    assert b.round_starts(10) == ([], True)
    assert b.round_starts(11) == ([10], False)  # asked for, not yet confirmed
    assert b.note(saved("b", "a", 10), committed=11) is None
    assert b.note(saved("c", "b", 10, span=(2, 4)), committed=11) is None
    assert b.round_starts(12) == ([10], True)
    assert b.b.kept == {10, 12}
    assert b.note(saved("b", "a", 12), committed=13) is None
    # a's newest is 12, b's still 10 (its replica of 12 is on its way), 12 was asked for last
    assert b.round_starts(13) == ([10, 12], False)


def test_no_replication_without_a_single_device_stage_or_with_every_zero() -> None:
    group = ReplicaBook(plan_of((0, 7, ["c", "d"])), epoch=5, start=0, every=1)
    assert group.round_starts(0)[1:] == ([], False)
    assert book(every=0).round_starts(10)[1:] == ([], False)


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (saved("b", "a", 10, epoch=4), "plan epoch 4, current is 5"),
        (saved("c", "a", 10), "c is not the backup node of stage 0"),
        (saved("b", "x", 10), "origin x is not in the plan"),
        (saved("b", "a", 10, span=(0, 3)), "layers [0, 3) are not stage 0's"),
        (saved("b", "a", 11), "version 11 was not replicated in this epoch"),
        (saved("b", "a", 8), "version 8 was not replicated in this epoch"),
        (saved("b", "a", 12), "version 12 was not replicated in this epoch"),
    ],
)
def test_a_report_the_plan_does_not_name_is_refused(msg: ReplicaSaved, why: str) -> None:
    b = Book(book())
    b.round_starts(10)
    b.round_starts(11)
    assert b.note(msg, committed=11) == why
    assert b.b.replicas == ()


def test_only_the_newest_replicas_of_a_stage_are_remembered() -> None:
    b = Book(book(every=1, start=0))
    for r in range(4):
        b.round_starts(r)
        assert b.note(saved("b", "a", r), committed=r) is None
    assert sorted(x.version for x in b.b.replicas) == [2, 3]


def test_recovery_only_uses_versions_every_device_still_holds() -> None:
    b = Book(book(every=1, start=0))
    b.round_starts(0)
    b.note(saved("b", "a", 0), committed=0)
    b.round_starts(1)
    b.note(saved("b", "a", 1), committed=1)
    b.round_starts(2)  # a's newest replica is 1, and 2 is this round's start
    assert b.b.kept == {1, 2}
    usable = b.b.usable(committed=2)
    assert usable == [Replica(DeviceId("a"), 0, 2, 1, DeviceId("b"))]
