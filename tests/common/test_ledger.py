"""The sample ledger: what rollbacks undo, and what a superseded one does not."""

from __future__ import annotations

import pytest

from common.ledger import effective_rounds, rollback_entry, round_entry


def _round(r: int) -> dict[str, object]:
    return round_entry(r, 1, 4 * r, 4 * r + 4, list(range(4 * r, 4 * r + 4)))


def test_a_rollback_undoes_the_rounds_from_its_version_on_and_they_are_replayed() -> None:
    entries = [_round(0), _round(1), _round(2), rollback_entry(1, ["b"]), _round(1), _round(2)]
    assert [e["round"] for e in effective_rounds(entries)] == [0, 1, 2]


def test_a_recovery_superseded_by_one_from_a_newer_version_keeps_the_rounds_that_version_holds():
    """Found by a chaos run: a first loss chose the replica of version 1, a second loss
    during that recovery made it start again from the checkpoint of version 2. Round 1
    stands (version 2's weights include it); the first marker alone dropped it for good,
    so the ledger said round 2 followed round 0 while the weights were exact."""
    entries = [
        _round(0),
        _round(1),
        rollback_entry(1, ["a"]),
        rollback_entry(2, ["a", "d"]),
        rollback_entry(2, ["a", "d", "e"]),
        _round(2),
        _round(3),
    ]
    assert [e["round"] for e in effective_rounds(entries)] == [0, 1, 2, 3]


def test_a_rollback_after_a_commit_is_final_for_the_rounds_it_undid() -> None:
    entries = [_round(0), _round(1), rollback_entry(1, ["a"]), _round(1), rollback_entry(2, ["b"])]
    kept = effective_rounds(entries)
    assert [e["round"] for e in kept] == [0, 1]
    assert kept[1] is entries[3]  # the replayed round 1, not the undone one


def test_a_round_applied_twice_is_still_an_error() -> None:
    with pytest.raises(ValueError, match="round 1 committed after round 1"):
        effective_rounds([_round(0), _round(1), _round(1)])
    with pytest.raises(ValueError, match="round 3 committed after round 1"):
        effective_rounds(
            [_round(0), _round(1), rollback_entry(1, ["a"]), rollback_entry(2, []), _round(3)]
        )
