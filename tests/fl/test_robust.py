"""Robust aggregation against plain references, and a poisoning home against the federation.

References are computed the plain way: flattened torch tensors for norm clipping,
scipy's ``trim_mean`` and numpy's ``median`` for the coordinate-wise rules, `fedavg`
of the honest homes alone for what a screened round must produce.
"""

import math
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from scipy.stats import trim_mean
from torch import Tensor

from common.fl.spec import FederationSpec, RobustAggregation
from services.federation.aggregate import fedavg
from services.federation.robust import (
    Screen,
    Update,
    clip_delta,
    coordinate_median,
    lower_median,
    trimmed_mean,
)
from services.federation.server import Federation, FederationError
from services.federation.strategies import FitResult, make_strategy, strategy_for

HOSTILE = 3e38
ALL_OF_THEM = 1 << 40


def states(n: int, seed: int = 0) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(4, 3, generator=gen),
            "b": torch.randn(3, generator=gen),
            "steps": torch.tensor(7 + i),
        }
        for i in range(n)
    ]


def flat(state: Mapping[str, Tensor]) -> Tensor:
    return torch.cat([state[k].double().flatten() for k in ("w", "b")])


def poisoned(like: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.full_like(v, HOSTILE) if v.is_floating_point() else v for k, v in like.items()}


def test_clip_delta_matches_the_plain_formula_and_leaves_a_short_delta_alone() -> None:
    base, far = states(2)
    norm = float((flat(far) - flat(base)).norm())
    radius = norm / 4
    clipped = clip_delta(far, base, radius)
    want = flat(base) + (flat(far) - flat(base)) * (radius / norm)
    assert torch.allclose(flat(clipped), want, atol=1e-6)
    assert math.isclose(float((flat(clipped) - flat(base)).norm()), radius, rel_tol=1e-6)
    assert clipped["steps"] is far["steps"]
    kept = clip_delta(far, base, norm * 2)
    assert all(torch.equal(kept[k], far[k]) for k in far)
    # a hostile model of 3e38 everywhere is brought back onto the ball too
    huge = clip_delta(poisoned(far), base, 1.0)
    assert math.isclose(float((flat(huge) - flat(base)).norm()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(("n", "trim"), [(5, 0.2), (7, 0.3), (4, 0.0), (10, 0.45)])
def test_trimmed_mean_matches_scipy(n: int, trim: float) -> None:
    group = states(n, seed=n)
    out = trimmed_mean(group, trim)
    for key in ("w", "b"):
        stacked = np.stack([s[key].double().numpy() for s in group])
        want = torch.from_numpy(trim_mean(stacked, trim, axis=0)).float()
        assert torch.allclose(out[key], want, atol=1e-6), key
    assert torch.equal(out["steps"], group[0]["steps"])


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_coordinate_median_matches_numpy(n: int) -> None:
    group = states(n, seed=10 + n)
    out = coordinate_median(group)
    for key in ("w", "b"):
        stacked = np.stack([s[key].double().numpy() for s in group])
        want = torch.from_numpy(np.median(stacked, axis=0)).float()
        assert torch.allclose(out[key], want, atol=1e-6), key


def test_median_and_trimmed_mean_ignore_a_minority_of_hostile_models() -> None:
    group = states(5)
    honest = group[:4]
    attacked = [*honest, poisoned(group[4])]
    for out in (coordinate_median(attacked), trimmed_mean(attacked, 0.2)):
        lo = torch.stack([flat(s) for s in honest]).min(dim=0).values
        hi = torch.stack([flat(s) for s in honest]).max(dim=0).values
        assert bool(((flat(out) >= lo - 1e-6) & (flat(out) <= hi + 1e-6)).all())


def test_lower_median_never_takes_the_larger_of_two() -> None:
    assert lower_median([1.0, 1e40]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(lower_median([]))


def honest_round(n: int = 4) -> tuple[dict[str, Tensor], list[Update]]:
    base, *trained = states(n + 1, seed=3)
    return base, [Update(h, s, 100 + 10 * h) for h, s in enumerate(trained)]


def test_the_default_screen_leaves_honest_homes_alone() -> None:
    base, updates = honest_round()
    kept, events = Screen(RobustAggregation())(base, updates)
    assert events == ()
    assert kept == updates  # the very same models and counts: FedAvg stays exact


def test_the_screen_rejects_a_hostile_update_and_names_the_home() -> None:
    base, updates = honest_round()
    hostile = Update(9, poisoned(base), 100)
    nan = {k: v.clone() for k, v in base.items()}
    nan["b"][0] = math.nan
    kept, events = Screen(RobustAggregation())(base, [*updates, hostile, Update(8, nan, 100)])
    assert kept == updates
    assert [(e.home, e.action) for e in events] == [(8, "rejected"), (9, "rejected")]
    assert "non-finite" in events[0].reason and "norm" in events[1].reason


def test_the_screen_clips_an_outlier_to_k_times_the_median_delta() -> None:
    base, updates = honest_round()
    norms = [float((flat(u.state) - flat(base)).norm()) for u in updates]
    median = lower_median(norms)
    direction = {k: v + 50 * median if v.is_floating_point() else v for k, v in base.items()}
    far = Update(7, direction, 100)
    kept, events = Screen(RobustAggregation(clip_norm=10))(base, [*updates, far])
    assert [(e.home, e.action) for e in events] == [(7, "clipped")]
    moved = float((flat(kept[-1].state) - flat(base)).norm())
    yardstick = lower_median([*norms, float((flat(far.state) - flat(base)).norm())])
    assert math.isclose(moved, 10 * yardstick, rel_tol=1e-5)
    assert kept[:-1] == updates


def test_the_screen_cuts_an_outsized_sample_count() -> None:
    base, updates = honest_round()
    big = Update(6, updates[0].state, 1_000_000)
    kept, events = Screen(RobustAggregation())(base, [*updates, big])
    assert [(e.home, e.action) for e in events] == [(6, "clipped")]
    assert kept[-1].num_samples == 10 * lower_median([u.num_samples for u in [*updates, big]])


def test_a_single_update_is_judged_against_the_rounds_before() -> None:
    screen = Screen(RobustAggregation())
    base, updates = honest_round()
    screen(base, updates)
    kept, events = screen(base, [Update(5, poisoned(base), 100)])
    assert kept == [] and [(e.home, e.action) for e in events] == [(5, "rejected")]


def test_the_spec_selects_the_rule_and_checks_its_fields() -> None:
    spec = FederationSpec.model_validate(
        {
            "federation_id": "f",
            "model": {"name": "fl_cnn", "num_classes": 10},
            "homes": 3,
            "strategy": "fedavg",
            "aggregation": {"combine": "median", "clip_norm": None},
        }
    )
    strategy = strategy_for(spec)
    assert strategy.robust.combine == "median" and strategy.robust.clip_norm is None
    group = states(3)
    results = [FitResult(h, s, 10, 0) for h, s in enumerate(group)]
    out = strategy.aggregate_fit(group[0], 0, results, [])
    assert torch.equal(out["w"], coordinate_median(group)["w"])
    for bad in ({"combine": "mode"}, {"clip_norm": 0.5}, {"trim": 0.5}, {"bogus": 1}):
        with pytest.raises(ValidationError):
            RobustAggregation.model_validate(bad)


def test_a_poisoning_home_neither_joins_with_2_40_samples_nor_moves_the_global_model() -> None:
    base = states(1, seed=5)[0]
    fed = Federation(make_strategy("fedavg"), base, 3, 5, 10.0)
    with pytest.raises(FederationError, match="home 2: claims 1099511627776 samples"):
        fed.join(2, ALL_OF_THEM, [ALL_OF_THEM])
    for home, n in enumerate((120, 80, 100_000)):
        fed.join(home, n, [n])
    tasks = [fed.task(h, 0.0) for h in range(3)]
    honest = states(2, seed=6)
    fed.submit(0, tasks[0].round_id, honest[0], 120, 1.0, 1.0)
    fed.submit(1, tasks[1].round_id, honest[1], 80, 1.0, 1.0)
    end = fed.submit(2, tasks[2].round_id, poisoned(base), 100_000, 1.0, 1.0)
    assert end is not None and end.version == 1
    assert [(e.home, e.action) for e in end.screened] == [(2, "rejected")]
    want = fedavg(honest, [120, 80])
    assert all(torch.equal(fed.state[k], want[k]) for k in want)
