from typing import get_args

import pytest
import torch

from common.errors import ConfigError
from common.fl.spec import STRATEGY_NAMES, StrategyName
from services.federation.strategies import (
    STRATEGIES,
    Astraea,
    EcoFL,
    FedAsync,
    FedAT,
    FedAvg,
    FitResult,
    make_strategy,
)

A, B = (10.0, 0.0), (0.0, 10.0)
LAT8 = [1.0, 4.0, 1.0, 4.0, 1.0, 4.0, 1.0, 4.0]
HIST8 = [A, B, A, B, B, A, B, A]


def result(home: int, value: float, samples: int, base: int) -> FitResult:
    return FitResult(home, {"w": torch.tensor([value])}, samples, base)


def test_strategies_are_selected_by_name() -> None:
    assert sorted(STRATEGIES) == ["astraea", "ecofl", "fedasync", "fedat", "fedavg"]
    assert isinstance(make_strategy("ecofl", groups=4), EcoFL)
    with pytest.raises(ConfigError, match="unknown strategy 'fedprox'"):
        make_strategy("fedprox")
    with pytest.raises(ConfigError):
        make_strategy("fedat", groups=0)
    with pytest.raises(ConfigError):
        make_strategy("fedat", alpha=0.0)


def test_the_spec_names_exactly_the_strategies_built() -> None:
    assert tuple(STRATEGIES) == STRATEGY_NAMES
    assert sorted(get_args(StrategyName)) == sorted(STRATEGY_NAMES)


def test_each_strategy_groups_as_its_paper_does() -> None:
    assert FedAvg().initial_groups(LAT8, HIST8) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert FedAsync().initial_groups(LAT8, HIST8) == tuple((h,) for h in range(8))
    assert FedAT(groups=4).initial_groups(LAT8, HIST8) == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert Astraea(groups=4).initial_groups(LAT8, HIST8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert EcoFL(groups=4).initial_groups(LAT8, HIST8) == ((2, 4), (0, 6), (3, 5), (1, 7))


def test_fedavg_replaces_the_global_model_by_the_weighted_mean() -> None:
    glob = {"w": torch.tensor([100.0])}
    out = FedAvg().aggregate_fit(glob, 3, [result(0, 0.0, 1, 3), result(1, 4.0, 3, 3)], [])
    assert torch.equal(out["w"], torch.tensor([3.0]))


def test_grouped_strategies_merge_with_staleness_weight() -> None:
    glob = {"w": torch.tensor([0.0])}
    results = [result(0, 0.0, 1, 1), result(1, 4.0, 3, 1)]  # group mean 3, base version 1
    for cls in (FedAsync, FedAT, Astraea, EcoFL):
        out = cls(alpha=0.6).aggregate_fit(glob, 4, results, [])
        # 0.6 * (4 - 1 + 1) ** -0.5 = 0.3
        assert out["w"].item() == pytest.approx(0.3 * 3.0)
    const = FedAT(alpha=0.6, staleness="constant").aggregate_fit(glob, 4, results, [])
    assert const["w"].item() == pytest.approx(0.6 * 3.0)


def test_a_round_where_every_home_failed_keeps_the_model() -> None:
    glob = {"w": torch.tensor([5.0])}
    for name in STRATEGIES:
        out = make_strategy(name).aggregate_fit(glob, 2, [], [0, 1])
        assert torch.equal(out["w"], glob["w"])


def test_only_ecofl_regroups_at_run_time() -> None:
    lat, hist = [1.0, 1.0, 4.0, 4.0], [A, B, A, B]
    for cls in (FedAT, Astraea):
        strategy = cls(groups=2)
        state = strategy.start(lat, hist)
        out = strategy.observe(state, 0, 4.0)
        assert out.action == "stay"
        assert out.state.groups == state.groups
        assert out.state.latencies[0] == 4.0
    eco = EcoFL(groups=2)
    state = eco.start(lat, hist)
    assert state.groups == ((0, 1), (2, 3))
    out = eco.observe(state, 0, 4.0)
    assert (out.action, out.state.groups) == ("move", ((1,), (0, 2, 3)))
