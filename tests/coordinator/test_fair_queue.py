"""The inference queue is fair between requesters: per-owner caps, owners served in turn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.coordinator.fair_queue import FairQueue


def test_owners_are_served_in_turn_each_in_arrival_order() -> None:
    q: FairQueue[str] = FairQueue(per_owner=16, total=64)
    for i in range(10):
        assert q.offer("greedy", f"g{i}") is None
    assert q.offer("polite", "p0") is None
    assert q.offer("other", "o0") is None
    order = [q.take() for _ in range(len(q))]
    assert order[:4] == ["g0", "p0", "o0", "g1"]  # the newcomer waits for one, not ten
    assert order[4:] == [f"g{i}" for i in range(2, 10)]
    assert q.take() is None and not q


def test_one_owner_holds_at_most_its_share_and_the_total_is_bounded() -> None:
    q: FairQueue[int] = FairQueue(per_owner=3, total=5)
    assert [q.offer("a", i) for i in range(3)] == [None] * 3
    assert q.offer("a", 3) == "3 requests of a already wait; try again later"
    assert q.offer("b", 0) is None and q.offer("c", 0) is None
    assert q.offer("d", 0) == "5 requests already wait; try again later"
    assert len(q) == 5


def test_drop_removes_expired_items_and_keeps_the_turns() -> None:
    q: FairQueue[int] = FairQueue(per_owner=10, total=100)
    for i in range(4):
        q.offer("a", i)
    q.offer("b", 10)
    q.offer("c", 20)
    assert q.drop(lambda x: x in (0, 1, 10)) == [0, 1, 10]
    assert len(q) == 3
    assert [q.take(), q.take(), q.take()] == [2, 20, 3]


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers()), max_size=200))
def test_nothing_is_lost_or_duplicated_and_each_owner_keeps_its_order(
    offers: list[tuple[str, int]],
) -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(per_owner=8, total=30)
    accepted = [(o, (o, n)) for o, n in offers if q.offer(o, (o, n)) is None]
    taken = []
    while (item := q.take()) is not None:
        taken.append(item)
    assert sorted(taken) == sorted(item for _, item in accepted)
    for owner in "abcde":
        assert [i for i in taken if i[0] == owner] == [i for o, i in accepted if o == owner]
    assert len(q) == 0
