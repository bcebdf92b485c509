"""The federation's pure state machine, driven by hand with tiny one-tensor models."""

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError
from services.federation.grouping import Groups
from services.federation.server import Federation, FederationError, Regroup, RoundEnd, StaleUpdate
from services.federation.strategies import Strategy, make_strategy

A, B = (10, 0), (0, 10)
ZERO = {"w": torch.tensor([0.0, 0.0])}


def model(*values: float) -> dict[str, Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float32)}


def federation(
    strategy: Strategy,
    histograms: Sequence[Sequence[int]],
    updates: int = 100,
    timeout: float = 10.0,
) -> Federation:
    fed = Federation(strategy, ZERO, len(histograms), updates, timeout)
    for home, hist in enumerate(histograms):
        fed.join(home, sum(hist), hist)
    return fed


def groups_of(fed: Federation) -> Groups:
    """The federation's groups (none before the warm-up round closed)."""
    assert fed.groups is not None, "no groups yet"
    return fed.groups.groups


def run_round(
    fed: Federation,
    homes: Sequence[int],
    latencies: Sequence[float],
    states: Sequence[dict[str, Tensor]] | None = None,
    now: float = 0.0,
) -> RoundEnd | None:
    """Every home asks for its task at `now`, then sends an update; the last close."""
    tasks = {h: fed.task(h, now) for h in homes}
    end = None
    for i, h in enumerate(homes):
        state = states[i] if states is not None else model(0.0, 0.0)
        samples = fed.joined[h].num_samples
        end = fed.submit(h, tasks[h].round_id, state, samples, latencies[i], now + latencies[i])
    return end


def test_join_refuses_bad_figures_and_takes_a_rejoin_with_the_same_data() -> None:
    fed = Federation(make_strategy("fedavg"), ZERO, 3, 5, 10.0)
    for bad in (-1, 3):
        with pytest.raises(FederationError, match=f"home {bad}: this federation has homes 0..2"):
            fed.join(bad, 10, A)
    with pytest.raises(FederationError, match="home 0: its label histogram sums to 10, not its 9"):
        fed.join(0, 9, A)
    with pytest.raises(FederationError, match="home 0"):
        fed.join(0, 0, (0, 0))
    fed.join(0, 10, A)
    with pytest.raises(FederationError, match="home 1: 3 classes, the federation has 2"):
        fed.join(1, 10, (5, 5, 0))
    with pytest.raises(FederationError, match="home 0 joined again with other data"):
        fed.join(0, 10, B)
    fed.join(0, 10, A)  # a restarted home: same figures, taken
    assert fed.joined.keys() == {0}


def test_everyone_waits_until_all_homes_joined_then_all_train_one_warmup_round() -> None:
    fed = Federation(make_strategy("fedat", groups=2), ZERO, 3, 5, 10.0)
    with pytest.raises(FederationError, match="home 0 has not joined"):
        fed.task(0, 0.0)
    fed.join(0, 10, A)
    fed.join(1, 10, B)
    assert fed.task(0, 0.0).status == "wait"
    assert fed.task(1, 0.0).state is None
    assert fed.rounds == {}
    fed.join(2, 10, A)
    tasks = [fed.task(h, 1.0) for h in range(3)]
    assert {t.status for t in tasks} == {"train"}
    assert len({t.round_id for t in tasks}) == 1
    warmup = fed.rounds[tasks[0].round_id]
    assert (warmup.group, warmup.members) == (Federation.WARMUP, (0, 1, 2))
    assert fed.groups is None
    fed.submit(0, tasks[0].round_id, model(1.0, 1.0), 10, 2.0, 3.0)
    assert fed.task(0, 3.0).status == "wait"  # sent its update, its round is not over


def test_fedavg_warmup_gives_the_sample_weighted_mean() -> None:
    fed = federation(make_strategy("fedavg"), [(1, 0), (0, 2), (2, 1)])
    states = [model(1.0, 0.0), model(4.0, 3.0), model(7.0, 9.0)]
    end = run_round(fed, [0, 1, 2], [1.0, 2.0, 3.0], states)
    # (1*1 + 2*4 + 3*7) / 6 = 5, (1*0 + 2*3 + 3*9) / 6 = 5.5
    assert end is not None
    assert (end.group, end.members, end.failed, end.version) == (-1, (0, 1, 2), (), 1)
    assert torch.equal(fed.state["w"], torch.tensor([5.0, 5.5]))
    assert groups_of(fed) == ((0, 1, 2),)


def test_warmup_latencies_form_fedat_tiers_and_ecofl_groups() -> None:
    # latencies 1, 1, 1.2, 1.2 and labels A, A, B, B:
    # FedAT tiers by latency: (0, 1), (2, 3).
    # Eco-FL: the tiers cost gap 1 + 1 = 2; pairing an A with a B costs gap 0 and a spread
    # of 0.2 / 1.1 per group, and 0.2 stays within RT = 0.5 * L^g, so the swap is taken;
    # the first of the four equal swaps (home 0 <-> home 2) gives (1, 2), (0, 3).
    lat = [1.0, 1.0, 1.2, 1.2]
    fedat = federation(make_strategy("fedat", groups=2), [A, A, B, B])
    run_round(fedat, range(4), lat)
    assert groups_of(fedat) == ((0, 1), (2, 3))
    eco = federation(make_strategy("ecofl", groups=2, rt_fraction=0.5), [A, A, B, B])
    run_round(eco, range(4), lat)
    assert groups_of(eco) == ((1, 2), (0, 3))
    assert eco.groups is not None and eco.groups.latencies == tuple(lat)


def test_groups_run_independently_and_a_stale_merge_is_weighted_by_staleness() -> None:
    alpha = 0.6
    fed = federation(make_strategy("fedat", groups=2, alpha=alpha), [A, A, B, B])
    run_round(fed, range(4), [1.0, 1.0, 5.0, 5.0], [model(2.0, 0.0)] * 4)
    assert groups_of(fed) == ((0, 1), (2, 3))
    # warm-up: w = (1 - 0.6) * 0 + 0.6 * 2 (fresh: s(0) = 1)
    g = torch.tensor([0.6 * 2.0, 0.0], dtype=torch.float64)
    slow = fed.task(2, 10.0)  # group 1 starts on version 1
    assert (slow.status, slow.version) == ("train", 1)
    for value in (4.0, 8.0):  # group 0 completes two rounds meanwhile
        end = run_round(fed, [0, 1], [1.0, 1.0], [model(value, 1.0)] * 2, now=10.0)
        assert end is not None and end.group == 0
        g = 0.4 * g + 0.6 * torch.tensor([value, 1.0], dtype=torch.float64)
        assert fed.task(3, 11.0).round_id == slow.round_id  # group 1 is still in its round
    assert fed.version == 3
    fed.submit(2, slow.round_id, model(10.0, 0.0), 10, 5.0, 15.0)
    end = fed.submit(3, slow.round_id, model(20.0, 30.0), 10, 5.0, 15.0)
    assert end is not None and (end.group, end.version) == (1, 4)
    # group model (10+20)/2, (0+30)/2; staleness t - tau = 3 - 1: weight 0.6 * 3 ** -0.5
    weight = alpha * (3 - 1 + 1) ** -0.5
    expected = (1 - weight) * g + weight * torch.tensor([15.0, 15.0], dtype=torch.float64)
    assert torch.allclose(fed.state["w"].double(), expected, rtol=1e-6, atol=1e-6)


def test_bad_updates_are_refused_naming_the_home() -> None:
    fed = federation(make_strategy("fedavg"), [A, B, A])
    rid = fed.task(0, 0.0).round_id
    fed.task(1, 0.0)
    fed.submit(0, rid, model(1.0, 1.0), 10, 1.0, 1.0)
    with pytest.raises(FederationError, match=f"home 0: already sent its update of round {rid}"):
        fed.submit(0, rid, model(1.0, 1.0), 10, 1.0, 1.0)
    with pytest.raises(StaleUpdate, match=f"home 1: round {rid + 7} is not running"):
        fed.submit(1, rid + 7, model(1.0, 1.0), 10, 1.0, 1.0)
    with pytest.raises(FederationError, match="home 1: trained on 11 samples, joined with 10"):
        fed.submit(1, rid, model(1.0, 1.0), 11, 1.0, 1.0)
    for latency in (0.0, -1.0, float("nan")):
        with pytest.raises(FederationError, match="home 1: latency must be > 0"):
            fed.submit(1, rid, model(1.0, 1.0), 10, latency, 1.0)
    with pytest.raises(FederationError, match="home 7 has not joined"):
        fed.submit(7, rid, model(1.0, 1.0), 10, 1.0, 1.0)
    assert fed.version == 0  # nothing refused counted
    fed.submit(1, rid, model(1.0, 1.0), 10, 1.0, 1.0)
    end = fed.submit(2, rid, model(1.0, 1.0), 10, 1.0, 1.0)
    assert end is not None and end.version == 1
    with pytest.raises(StaleUpdate, match=f"home 2: round {rid} is not running"):
        fed.submit(2, rid, model(1.0, 1.0), 10, 1.0, 2.0)


def test_expire_closes_a_round_with_the_updates_it_has() -> None:
    fed = federation(make_strategy("fedat", groups=2), [(1, 0), (0, 3), (2, 2)], timeout=10.0)
    rid = fed.task(0, 0.0).round_id
    assert fed.task(1, 0.0).round_id == fed.task(2, 0.0).round_id == rid
    fed.submit(0, rid, model(2.0, 0.0), 1, 2.0, 2.0)
    fed.submit(1, rid, model(6.0, 4.0), 3, 3.0, 3.0)
    assert fed.expire(5.0) == []
    assert fed.expire(10.0) == []  # not yet older than the timeout
    ends = fed.expire(11.5)
    assert len(ends) == 1
    assert (ends[0].round_id, ends[0].failed, ends[0].version) == (rid, (2,), 1)
    # the two updates: group model (1*2 + 3*6)/4 = 5, (1*0 + 3*4)/4 = 3; merged with 0.6
    assert torch.allclose(fed.state["w"], torch.tensor([3.0, 1.8]))
    assert fed.groups is not None
    assert fed.groups.latencies == (2.0, 3.0, 11.5)  # the silent home: the time waited
    assert fed.groups.groups == ((0, 1), (2,))
    with pytest.raises(StaleUpdate, match="home 2"):
        fed.submit(2, rid, model(1.0, 1.0), 4, 1.0, 12.0)
    assert fed.expire(100.0) == []


def test_a_home_moved_into_a_running_group_waits_for_its_next_round() -> None:
    # same labels everywhere, latencies 1, 1, 4, 4: Eco-FL keeps the tiers (0, 1), (2, 3)
    fed = federation(make_strategy("ecofl", groups=2, rt_fraction=0.5), [A] * 4)
    run_round(fed, range(4), [1.0, 1.0, 4.0, 4.0])
    assert groups_of(fed) == ((0, 1), (2, 3))
    slow = fed.task(2, 10.0)
    assert fed.task(3, 10.0).round_id == slow.round_id
    # home 1 now takes 4 s: |L^0 - 4| = 3 > 0.5 * 1, and 4 lies in group 1's band 4 +- 2
    end = run_round(fed, [0, 1], [1.0, 4.0], now=10.0)
    assert end is not None and end.regroups == (Regroup(1, "move", 1),)
    assert groups_of(fed) == ((0,), (1, 2, 3))
    assert fed.task(1, 15.0).status == "wait"
    assert fed.task(0, 15.0).status == "train"  # group 0 goes on without it
    fed.submit(2, slow.round_id, model(0.0, 0.0), 10, 4.0, 14.0)
    fed.submit(3, slow.round_id, model(0.0, 0.0), 10, 4.0, 14.0)
    task = fed.task(1, 16.0)
    assert task.status == "train"
    assert fed.rounds[task.round_id].members == (1, 2, 3)


def test_a_dropped_home_probes_without_changing_the_model_and_rejoins() -> None:
    fed = federation(make_strategy("ecofl", groups=2, rt_fraction=0.1), [A] * 4)
    run_round(fed, range(4), [1.0, 1.0, 4.0, 4.0], [model(1.0, 2.0)] * 4)
    # home 1 jumps to 10 s: out of 1 +- 0.1 and of 4 +- 0.4, so it drops out
    end = run_round(fed, [0, 1], [1.0, 10.0], [model(1.0, 2.0)] * 2, now=10.0)
    assert end is not None and end.regroups == (Regroup(1, "drop", None),)
    assert fed.groups is not None and fed.groups.dropped == frozenset({1})
    before, version = fed.state["w"].clone(), fed.version
    probe = fed.task(1, 30.0)
    assert probe.status == "probe" and probe.state is not None
    assert torch.equal(probe.state["w"], before)
    out = fed.submit(1, probe.round_id, model(1000.0, -1000.0), 10, 9.0, 39.0)
    assert out is not None and (out.group, out.regroups, out.version) == (None, (), version)
    assert torch.equal(fed.state["w"], before)
    again = fed.task(1, 40.0)
    assert again.status == "probe"
    back = fed.submit(1, again.round_id, model(1000.0, -1000.0), 10, 1.05, 41.05)
    assert back is not None and back.regroups == (Regroup(1, "rejoin", 0),)
    assert torch.equal(fed.state["w"], before) and fed.version == version
    assert fed.groups.groups == ((0, 1), (2, 3)) and fed.groups.dropped == frozenset()
    assert fed.task(1, 42.0).status == "train"


def test_done_after_the_last_update_and_a_late_round_changes_nothing() -> None:
    fed = federation(make_strategy("fedat", groups=2), [A] * 4, updates=2)
    run_round(fed, range(4), [1.0, 1.0, 4.0, 4.0], [model(1.0, 1.0)] * 4)
    assert not fed.done
    late = fed.task(2, 10.0)
    end = run_round(fed, [0, 1], [1.0, 1.0], [model(5.0, 5.0)] * 2, now=10.0)
    assert end is not None and end.version == 2 and fed.done
    final = fed.state["w"].clone()
    assert fed.task(0, 12.0).status == "done"
    assert fed.task(3, 12.0).status == "done"
    fed.submit(2, late.round_id, model(99.0, 99.0), 10, 4.0, 14.0)
    end = fed.submit(3, late.round_id, model(99.0, 99.0), 10, 4.0, 14.0)
    assert end is not None and end.version == 2
    assert torch.equal(fed.state["w"], final)
    assert fed.rounds == {}


def test_bad_federation_parameters_are_refused() -> None:
    for homes, updates, timeout in ((0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0)):
        with pytest.raises(ConfigError, match="need homes >= 1"):
            Federation(make_strategy("fedavg"), ZERO, homes, updates, timeout)


def test_a_restored_federation_has_the_same_homes_groups_and_model() -> None:
    strategy = make_strategy("fedat", groups=2)
    fed = federation(strategy, [A, A, B, B])
    run_round(fed, [0, 1, 2, 3], [1.0, 1.0, 3.0, 3.0], [model(4.0, 4.0)] * 4)
    assert fed.version == 1 and groups_of(fed) == ((0, 1), (2, 3))
    snap = fed.snapshot()
    again = Federation(strategy, ZERO, 4, 100, 10.0, first_round=1 << 32)
    again.restore(snap, fed.state)
    assert again.version == 1 and again.joined == fed.joined and again.groups == fed.groups
    assert torch.equal(again.state["w"], fed.state["w"])
    task = again.task(0, 0.0)  # a new round, with an id the first run never gave
    assert task.status == "train" and task.round_id == 1 << 32 and task.version == 1
    with pytest.raises(StaleUpdate, match="round 1 is not running"):
        again.submit(2, 1, model(0.0, 0.0), 10, 1.0, 0.0)  # an update for the old run's round


def test_a_stored_state_for_other_homes_is_refused() -> None:
    fed = federation(make_strategy("fedavg"), [A, B])
    snap = fed.snapshot()
    with pytest.raises(FederationError, match=r"home 2: this federation has homes 0\.\.1"):
        Federation(make_strategy("fedavg"), ZERO, 2, 5, 10.0).restore(
            {**snap, "joined": {"2": [10, list(A)]}}, ZERO
        )
    with pytest.raises(FederationError, match="does not fit"):
        Federation(make_strategy("fedavg"), ZERO, 2, 5, 10.0).restore({"version": 0}, ZERO)


def test_a_round_end_carries_its_members_latencies_and_a_failed_homes_wait() -> None:
    fed = federation(make_strategy("fedat", groups=2), [A, B, A], timeout=10.0)
    end = run_round(fed, range(3), [1.0, 2.5, 4.0])
    assert end is not None and end.members == (0, 1, 2) and end.latencies == (1.0, 2.5, 4.0)
    rid = fed.task(0, 20.0).round_id
    fed.submit(0, rid, model(0.0, 0.0), 10, 1.5, 21.5)
    (late,) = fed.expire(31.0)
    assert late.members == (0, 1) and late.failed == (1,) and late.latencies == (1.5, 11.0)
