"""Vertical sync's version arithmetic against a replay of the first stage's 1F1B order.

The pipeline is not drained between windows: the replay is one 1F1B over the
stream of several windows' micro-batches, aggregation after every
`aggregate_every`-th update of a window.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from common.async_versions import changes_after, changes_per_window, version_for


def _replayed(m: int, windows: int, k0: int, every: int) -> list[int]:
    """The version current at each forward when the first stage runs 1F1B over the stream."""
    n = m * windows
    warm = min(k0, n)
    order = [("F", g) for g in range(warm)]
    for g in range(n):
        order.append(("B", g))
        if warm + g < n:
            order.append(("F", warm + g))
    version, seen, at_window_end = 0, {}, []
    for kind, g in order:
        if kind == "F":
            seen[g] = version
            continue
        version += 1
        if every and (g % m + 1) % every == 0:
            version += 1
        assert version == changes_after(g, every, m)
        if g % m == m - 1:
            at_window_end.append(version)
    # every window adds the same versions: the checkpoints' count needs no history
    assert at_window_end == [w * changes_per_window(m, every) for w in range(1, windows + 1)]
    return [seen[g] for g in range(n)]


@given(st.integers(1, 20), st.integers(1, 4), st.integers(1, 12), st.integers(0, 9))
def test_every_micro_batch_gets_the_version_the_first_stage_held(m, windows, k0, every):
    k = min(k0, m)  # the plan caps K_0 at M
    got = [version_for(g, k, every, m) for g in range(m * windows)]
    assert got == _replayed(m, windows, k, every)


def test_the_warm_up_runs_on_the_starting_weights_and_versions_run_on_across_windows():
    assert [version_for(g, 3, 0, 4) for g in range(8)] == [0, 0, 0, 1, 2, 3, 4, 5]
    # aggregation after every second update adds a version: 1, 2+agg=3, 4, 5+agg=6
    assert [version_for(g, 3, 2, 8) for g in range(7)] == [0, 0, 0, 1, 3, 4, 6]
    # a window of 5 with aggregate_every 2: the 2nd and 4th update of each window aggregate
    assert [changes_after(g, 2, 5) for g in range(10)] == [1, 3, 4, 6, 7, 8, 10, 11, 13, 14]
