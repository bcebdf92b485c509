from dataclasses import replace

import pytest
import torch

from common.errors import ConfigError
from common.fl.data import DigitsSplit, dirichlet_split, load_digits_split
from common.zoo import ModelSpec, build_model
from services.federation.simulate import (
    DIGITS_CNN,
    SimConfig,
    SlowDown,
    latency_at,
    round_seed,
    simulate,
)
from services.federation.strategies import make_strategy


@pytest.fixture(scope="module")
def digits() -> DigitsSplit:
    return load_digits_split(seed=0)


def test_fl_cnn_takes_digits_and_cifar() -> None:
    digits_net = build_model(ModelSpec(name="fl_cnn", options=dict(DIGITS_CNN)), seed=0)
    assert len(digits_net.layers) == 4 and not digits_net.has_batchnorm
    assert digits_net.input.shape == (1, 8, 8)
    assert digits_net.full()(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    cifar = build_model(ModelSpec(name="fl_cnn", options={"width": 4, "hidden": 8}), seed=0)
    assert cifar.input.shape == (3, 32, 32)
    assert cifar.full()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    convs = [m for m in cifar.full().modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.padding) for c in convs] == [((5, 5), (2, 2))] * 2
    for bad in ({"size": 10}, {"depth": 2}):
        with pytest.raises(ConfigError):
            build_model(ModelSpec(name="fl_cnn", options=bad), seed=0)


def test_latency_follows_the_slowdown_schedule() -> None:
    cfg = SimConfig(round_times=(1.0, 2.0), slowdowns=(SlowDown(1, 4.0, 3.0), SlowDown(1, 9, 2)))
    assert [latency_at(cfg, 1, t) for t in (0.0, 3.9, 4.0, 9.0)] == [2.0, 2.0, 6.0, 12.0]
    assert latency_at(cfg, 0, 100.0) == 1.0
    with pytest.raises(ConfigError):
        SimConfig(round_times=(1.0,), slowdowns=(SlowDown(1, 0.0, 2.0),))
    with pytest.raises(ConfigError):
        SimConfig(round_times=(1.0, 0.0))


def test_virtual_clock_of_synchronous_and_tiered_rounds(digits: DigitsSplit) -> None:
    sync = SimConfig(round_times=(1.0, 2.0, 3.0), updates=3, local_steps=1, min_size=1)
    assert [p.time for p in simulate(make_strategy("fedavg"), sync, digits).curve] == [0, 3, 6, 9]
    slowed = replace(sync, slowdowns=(SlowDown(2, 4.0, 3.0),))
    # the third round starts at 6, after the slow-down: it lasts 3 * 3
    assert [p.time for p in simulate(make_strategy("fedavg"), slowed, digits).curve] == [
        0,
        3,
        6,
        15,
    ]
    tiers = replace(sync, round_times=(1.0, 1.0, 3.0, 3.0), updates=5)
    run = simulate(make_strategy("fedat", groups=2), tiers, digits)
    assert run.initial_groups == ((0, 1), (2, 3))
    assert [p.time for p in run.curve] == [0, 1, 2, 3, 3, 4]


def plain_sgd(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, steps: int, lr: float
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    for _ in range(steps):
        idx = torch.randperm(len(y), generator=gen)[:32]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.copy_(p - lr * g)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_fedavg_update_equals_averaged_plain_sgd(digits: DigitsSplit) -> None:
    cfg = SimConfig(round_times=(1.0, 2.0), updates=1, local_steps=3, dirichlet_alpha=0.5)
    run = simulate(make_strategy("fedavg"), cfg, digits)
    parts = dirichlet_split(digits.train_y, 2, 0.5, seed=0, min_size=cfg.min_size)
    spec = ModelSpec(name="fl_cnn", options=dict(DIGITS_CNN))
    trained = []
    for home, part in enumerate(parts):
        model = build_model(spec, seed=0).full()
        x, y = digits.train_x[part], digits.train_y[part]
        trained.append(plain_sgd(model, x, y, round_seed(0, home, 0), 3, cfg.lr))
    n0, n1 = len(parts[0]), len(parts[1])
    for key, value in run.final_state.items():
        expected = (n0 * trained[0][key] + n1 * trained[1][key]) / (n0 + n1)
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


def test_fedavg_learns_digits_well_above_chance(digits: DigitsSplit) -> None:
    cfg = SimConfig(round_times=(1.0, 1.2, 2.0, 2.5), dirichlet_alpha=100.0, updates=20)
    curve = simulate(make_strategy("fedavg"), cfg, digits).curve
    assert len(curve) == 21 and [p.version for p in curve] == list(range(21))
    assert curve[0].accuracy < 0.25
    assert curve[-1].accuracy > 0.6


def test_runs_are_deterministic_for_a_seed_and_ecofl_regroups(digits: DigitsSplit) -> None:
    cfg = SimConfig(
        round_times=(1.0, 1.2, 2.0, 2.5),
        slowdowns=(SlowDown(1, 2.0, 3.0),),
        dirichlet_alpha=0.5,
        updates=8,
        local_steps=3,
    )
    first = simulate(make_strategy("ecofl", groups=2), cfg, digits)
    second = simulate(make_strategy("ecofl", groups=2), cfg, digits)
    assert first.curve == second.curve and first.events == second.events
    assert all(torch.equal(v, second.final_state[k]) for k, v in first.final_state.items())
    # home 1 (group 0 with home 0, latency 1) turns 3.6 s: outside 1 +- 0.5 and 2.25 +- 1.125
    assert [(e.home, e.action) for e in first.events] == [(1, "drop")]
    assert first.final_groups == ((0,), (2, 3))
    static = simulate(make_strategy("fedat", groups=2), cfg, digits)
    assert static.events == () and static.final_groups == ((0, 1), (2, 3))
    reseeded = simulate(make_strategy("ecofl", groups=2), replace(cfg, seed=1), digits)
    assert reseeded.curve != first.curve
