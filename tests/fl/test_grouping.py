import pytest

from common.errors import ConfigError
from services.federation.grouping import (
    GroupState,
    astraea_groups,
    data_gap,
    fedat_groups,
    group_cost,
    group_homes,
    group_latency,
    join_cost,
    out_of_band,
    regroup,
)
from services.federation.strategies import make_strategy

A, B = (10.0, 0.0), (0.0, 10.0)
# Fast homes 0, 2, 4, 6 and slow homes 1, 3, 5, 7; labels A, B, A, B, B, A, B, A.
LAT8 = [1.0, 4.0, 1.0, 4.0, 1.0, 4.0, 1.0, 4.0]
HIST8 = [A, B, A, B, B, A, B, A]


def total_cost(groups: tuple[tuple[int, ...], ...], weight: float = 1.0) -> float:
    return sum(group_cost(g, LAT8, HIST8, weight) for g in groups)


def test_data_gap_is_l1_of_normalised_histograms() -> None:
    assert data_gap([1, 3], [1, 1]) == pytest.approx(0.5)
    assert data_gap([5, 5], [2, 2]) == 0.0
    assert data_gap([1, 0], [0, 7]) == pytest.approx(2.0)


@pytest.mark.parametrize(("h", "t"), [([1, 2], [1, 2, 3]), ([0, 0], [1, 1]), ([1], [0])])
def test_data_gap_rejects_bad_histograms(h: list[int], t: list[int]) -> None:
    with pytest.raises(ConfigError):
        data_gap(h, t)


def test_group_cost_adds_data_gap_and_relative_latency_spread() -> None:
    lat, hist = [1.0, 2.0, 10.0, 11.0], [A, A, B, B]  # mean latency 6
    assert group_cost((0, 1), lat, hist) == pytest.approx(1.0 + 1.0 / 6)
    assert group_cost((0, 2), lat, hist) == pytest.approx(0.0 + 9.0 / 6)
    assert group_cost((0, 2), lat, hist, latency_weight=0.0) == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        group_cost((), lat, hist)


def test_fedat_tiers_by_latency_with_ties_by_id() -> None:
    assert fedat_groups([3.0, 1.0, 2.0, 1.0], 2) == ((1, 3), (0, 2))
    assert fedat_groups([5.0, 4.0, 3.0, 2.0, 1.0], 2) == ((2, 3, 4), (0, 1))
    assert fedat_groups(LAT8, 2) == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_astraea_greedy_balances_labels_ignoring_latency() -> None:
    assert astraea_groups(HIST8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # three classes: the greedy completes the label mix before closing a group
    hist = [(6.0, 0.0, 0.0), (6.0, 0.0, 0.0), (0.0, 6.0, 0.0), (0.0, 0.0, 6.0), (0.0, 6.0, 0.0)]
    assert astraea_groups(hist, 2) == ((0, 2, 3), (1, 4))


def test_ecofl_grouping_is_close_in_latency_and_iid_in_data() -> None:
    fedat = fedat_groups(LAT8, 4)
    astraea = astraea_groups(HIST8, 4)
    eco = group_homes(LAT8, HIST8, 4)
    assert fedat == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert eco == ((2, 4), (0, 6), (3, 5), (1, 7))
    for g in eco:  # one label of each kind, one latency
        labels = [sum(c) for c in zip(*(HIST8[h] for h in g), strict=True)]
        assert data_gap(labels, [1, 1]) == 0.0
        assert len({LAT8[h] for h in g}) == 1
    assert total_cost(eco) == 0.0
    assert total_cost(fedat) == pytest.approx(4.0)  # each tier holds one label only
    assert total_cost(astraea) == pytest.approx(4 * 3.0 / 2.5)  # each group spans 1..4


def test_ecofl_latency_weight_trades_spread_for_data() -> None:
    lat, hist = [1.0, 2.0, 10.0, 11.0], [A, A, B, B]
    # tiers cost 2 + w/3, any A-B pairing 3w: keep tiers for w=1, pair up for w=0.5
    assert group_homes(lat, hist, 2, latency_weight=1.0) == ((0, 1), (2, 3))
    mixed = group_homes(lat, hist, 2, latency_weight=0.5)
    assert all({hist[h] for h in g} == {A, B} for g in mixed)


@pytest.mark.parametrize("groups", [0, 5])
def test_grouping_rejects_bad_group_counts(groups: int) -> None:
    with pytest.raises(ConfigError):
        group_homes([1.0] * 4, [A] * 4, groups)
    with pytest.raises(ConfigError):
        fedat_groups([1.0] * 4, groups)


def test_grouping_rejects_non_positive_latency_and_missing_histograms() -> None:
    with pytest.raises(ConfigError):
        group_homes([1.0, 0.0], [A, B], 1)
    with pytest.raises(ConfigError):
        group_homes([1.0, 2.0], [A], 1)


def three_groups() -> GroupState:
    return GroupState(
        groups=((0, 1), (2, 3), (4, 5)),
        latencies=(1.0, 1.0, 4.0, 4.0, 4.2, 4.2),
        histograms=(A, B, A, A, A, B),
    )


def test_group_latency_excludes_the_home_itself() -> None:
    s = three_groups()
    assert group_latency(s, 1) == 4.0
    assert group_latency(s, 0, exclude=0) == 1.0
    single = GroupState(groups=((0,), (1,)), latencies=(1.0, 2.0), histograms=(A, B))
    assert group_latency(single, 0, exclude=0) is None


def test_regroup_keeps_a_home_within_its_band() -> None:
    s = three_groups()
    out = regroup(s, 0, 1.4)  # L^0 = 1 (home 1), RT^0 = 0.5
    assert (out.action, out.group, out.state.groups) == ("stay", 0, s.groups)
    assert out.state.latencies[0] == 1.4
    edge = regroup(s, 0, 1.5)  # |L^g - L_n| = RT^g is not "> RT^g"
    assert (edge.action, edge.group) == ("stay", 0)


def test_regroup_moves_to_the_fitting_group_of_minimum_cost() -> None:
    s = three_groups()
    out = regroup(s, 0, 4.1)  # fits group 1 (4 +- 2) and group 2 (4.2 +- 2.1)
    mean = (4.1 + 1 + 4 + 4 + 4.2 + 4.2) / 6
    assert join_cost(out.state, 1, 0) == pytest.approx(2 / 3 + 0.1 / mean)  # all A
    assert join_cost(out.state, 2, 0) == pytest.approx(0.0 + 0.1 / mean)  # 2 A : 1 B, global
    assert (out.action, out.group) == ("move", 2)
    assert out.state.groups == ((1,), (2, 3), (0, 4, 5))
    assert out.state.dropped == frozenset()


def test_regroup_drops_a_home_that_fits_no_group_and_rejoins_it_later() -> None:
    s = three_groups()
    dropped = regroup(s, 0, 10.0)  # 4 +- 2 and 4.2 +- 2.1 both miss 10
    assert (dropped.action, dropped.group) == ("drop", None)
    assert dropped.state.groups == ((1,), (2, 3), (4, 5))
    assert dropped.state.dropped == frozenset({0})
    still = regroup(dropped.state, 0, 9.0)
    assert (still.action, still.group, still.state.dropped) == ("out", None, frozenset({0}))
    back = regroup(still.state, 0, 1.2)  # group 0 is home 1 alone: 1 +- 0.5
    assert (back.action, back.group) == ("rejoin", 0)
    assert back.state.groups == ((0, 1), (2, 3), (4, 5))
    assert back.state.dropped == frozenset()


def test_regroup_threshold_scales_with_rt_fraction() -> None:
    s = GroupState(
        groups=((0, 1), (2, 3)),
        latencies=(1.0, 1.0, 4.0, 4.0),
        histograms=(A, B, A, B),
        rt_fraction=3.5,
    )
    assert regroup(s, 0, 4.0).action == "stay"  # band 1 +- 3.5
    tight = GroupState(s.groups, s.latencies, s.histograms, rt_fraction=0.5)
    assert (regroup(tight, 0, 4.0).action, regroup(tight, 0, 4.0).group) == ("move", 1)


def test_a_lone_home_follows_its_own_latency_and_empty_groups_take_nobody() -> None:
    s = GroupState(groups=((0,), (1, 2), ()), latencies=(1.0, 1.0, 1.0), histograms=(A, B, A))
    assert regroup(s, 0, 100.0).action == "stay"
    out = regroup(s, 1, 50.0)  # group 0 is 1 +- 0.5, group 2 has no L^g
    assert (out.action, out.state.groups) == ("drop", ((0,), (2,), ()))


def test_group_state_and_regroup_validate_input() -> None:
    with pytest.raises(ConfigError):
        GroupState(groups=((0,),), latencies=(1.0, 1.0), histograms=(A, B))
    with pytest.raises(ConfigError):
        GroupState(groups=((0, 1), (1,)), latencies=(1.0, 1.0), histograms=(A, B))
    with pytest.raises(ConfigError):
        GroupState(groups=((0, 1),), latencies=(1.0, 1.0), histograms=(A, B), rt_fraction=0)
    s = three_groups()
    with pytest.raises(ConfigError):
        regroup(s, 6, 1.0)
    with pytest.raises(ConfigError):
        regroup(s, 0, 0.0)


def test_out_of_band_counts_members_off_the_mean_of_the_others() -> None:
    lat = [1.0, 2.0, 3.0, 10.0]
    assert out_of_band((0,), lat, 0.01) == 0  # a lone member is always inside
    assert out_of_band((0, 1), lat, 0.5) == 1  # 0: |2 - 1| = 1 <= 1; 1: |1 - 2| = 1 > 0.5
    assert out_of_band((0, 1), lat, 1.0) == 0
    # (0, 1, 2): home 0 sees 2.5 (off by 1.5), home 1 sees 2 (off by 0), home 2 sees 1.5
    # (off by 1.5); bands 2.5 r, 2 r, 1.5 r
    assert out_of_band((0, 1, 2), lat, 0.5) == 2  # 1.5 > 1.25 and 1.5 > 0.75
    assert out_of_band((0, 1, 2), lat, 0.8) == 1  # home 0 inside (1.5 <= 2), home 2 not
    assert out_of_band((0, 1, 2), lat, 1.0) == 0  # 1.5 > 1.5 is false for home 2
    # (0, 1, 2, 3): off by |5 - 1| = 4 > 2.5, |14/3 - 2| > 7/3, |13/3 - 3| <= 13/6, 8 > 1
    assert out_of_band((0, 1, 2, 3), lat, 0.5) == 3
    assert out_of_band((), lat, 0.5) == 0


# Latencies 1, 1, 2, 2 and labels A, A, B, B (found by a search over latencies {1, 2, 4}
# and labels {A, B} for 4 homes in 2 groups), by hand:
# - the tiers (0, 1), (2, 3) cost data gap 1 + 1 = 2 and no spread;
# - an A-B pair costs gap 0 and spread (2 - 1) / 1.5 = 2/3, two pairs 4/3 < 2, so the
#   plain grouping swaps homes 0 and 2 (the first of four equal swaps): (1, 2), (0, 3);
# - in (1, 2) with RT = 0.5 * L^g, home 1 sees L^g = 2, |2 - 1| = 1 <= 1: inside, but
#   home 2 sees L^g = 1, |1 - 2| = 1 > 0.5: outside; the same in (0, 3): 2 strays, so
#   with rt_fraction = 0.5 the swap is refused and the tiers (0 strays) stay.
LAT_RT = [1.0, 1.0, 2.0, 2.0]
HIST_RT = [A, A, B, B]


def test_rt_fraction_keeps_every_home_inside_its_band_from_the_start() -> None:
    plain = group_homes(LAT_RT, HIST_RT, 2)
    banded = group_homes(LAT_RT, HIST_RT, 2, rt_fraction=0.5)
    assert plain == ((1, 2), (0, 3))
    assert banded == ((0, 1), (2, 3))
    assert [out_of_band(g, LAT_RT, 0.5) for g in plain] == [1, 1]
    assert [out_of_band(g, LAT_RT, 0.5) for g in banded] == [0, 0]
    unbanded = GroupState(plain, tuple(LAT_RT), tuple(HIST_RT), rt_fraction=0.5)
    assert regroup(unbanded, 2, LAT_RT[2]).action == "move"  # undone at once
    state = GroupState(banded, tuple(LAT_RT), tuple(HIST_RT), rt_fraction=0.5)
    for home, latency in enumerate(LAT_RT):
        assert regroup(state, home, latency).action == "stay"


def test_ecofl_strategy_groups_within_its_band() -> None:
    strategy = make_strategy("ecofl", groups=2, rt_fraction=0.5)
    state = strategy.start(LAT_RT, HIST_RT)
    assert (state.groups, state.rt_fraction) == (((0, 1), (2, 3)), 0.5)
    for home, latency in enumerate(LAT_RT):
        out = strategy.observe(state, home, latency)
        assert (out.action, out.group) == ("stay", state.group_of(home))
        state = out.state
    assert state.groups == ((0, 1), (2, 3)) and state.dropped == frozenset()
