"""Vertical sync's version arithmetic against a replay of the first stage's 1F1B order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.async_versions import changes_per_window, version_for


def _replayed(m: int, k0: int, every: int) -> list[int]:
    """The version current at each forward when the first stage runs textbook 1F1B."""
    warm = min(k0, m)
    order = [("F", j) for j in range(warm)]
    for j in range(m):
        order.append(("B", j))
        if warm + j < m:
            order.append(("F", warm + j))
    version, updates, seen = 0, 0, {}
    for kind, j in order:
        if kind == "F":
            seen[j] = version
            continue
        version, updates = version + 1, updates + 1
        if every and updates % every == 0:
            version += 1
    assert version == changes_per_window(m, every)
    return [seen[j] for j in range(m)]


@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 9))
def test_every_micro_batch_gets_the_version_the_first_stage_held(m, k0, every):
    assert [version_for(j, min(k0, m), every) for j in range(m)] == _replayed(m, k0, every)


def test_the_warm_up_runs_on_the_windows_starting_weights():
    assert [version_for(j, 3, 0) for j in range(6)] == [0, 0, 0, 1, 2, 3]
    # aggregation after every second update adds a version: 1, 2+agg=3, 4, 5+agg=6
    assert [version_for(j, 3, 2) for j in range(7)] == [0, 0, 0, 1, 3, 4, 6]
