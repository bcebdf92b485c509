import pytest
import torch

from common.errors import ConfigError
from services.federation.aggregate import async_merge, fedavg, staleness_weight


def test_fedavg_is_the_sample_weighted_mean() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0]), "n": torch.tensor(7)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([4.0]), "n": torch.tensor(9)}
    out = fedavg([a, b], [1, 3])
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0]))  # (1*1 + 3*3) / 4, (2 + 18) / 4
    assert torch.equal(out["b"], torch.tensor([3.0]))
    assert torch.equal(out["n"], torch.tensor(7))  # counters are not averaged
    assert out["w"].dtype == torch.float32


def test_fedavg_matches_a_plain_loop_on_random_states() -> None:
    gen = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(3, 4, generator=gen)} for _ in range(5)]
    weights = [13, 1, 7, 2, 40]
    expected = sum(w * s["w"].double() for w, s in zip(weights, states, strict=True)) / 63
    assert isinstance(expected, torch.Tensor)
    assert torch.equal(fedavg(states, weights)["w"], expected.float())


def test_fedavg_of_identical_states_is_that_state_exactly() -> None:
    w = torch.randn(50)
    assert torch.equal(fedavg([{"w": w}] * 3, [1, 2, 3])["w"], w)


@pytest.mark.parametrize(
    ("states", "weights"),
    [
        ([], []),
        ([{"w": torch.zeros(2)}], [1, 2]),
        ([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}], [1, 1]),
        ([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}], [1, 1]),
        ([{"w": torch.zeros(2)}, {"w": torch.zeros(2)}], [0, 0]),
        ([{"w": torch.zeros(2)}, {"w": torch.zeros(2)}], [2, -1]),
    ],
)
def test_fedavg_rejects_mismatched_input(
    states: list[dict[str, torch.Tensor]], weights: list[float]
) -> None:
    with pytest.raises(ConfigError):
        fedavg(states, weights)


def test_polynomial_staleness_decays_with_age() -> None:
    assert staleness_weight(5, 5) == 1.0
    assert staleness_weight(5, 2) == pytest.approx(0.5)  # (5 - 2 + 1) ** -0.5
    assert staleness_weight(3, 0, exponent=1.0) == pytest.approx(0.25)
    assert staleness_weight(9, 1, "constant") == 1.0


@pytest.mark.parametrize(
    ("now", "base", "kind", "exponent"),
    [(2, 3, "polynomial", 0.5), (2, -1, "constant", 0.5), (3, 1, "polynomial", -1.0)],
)
def test_staleness_rejects_bad_input(now: int, base: int, kind: str, exponent: float) -> None:
    with pytest.raises(ConfigError):
        staleness_weight(now, base, kind, exponent)  # type: ignore[arg-type]


def test_staleness_rejects_unknown_kind() -> None:
    with pytest.raises(ConfigError):
        staleness_weight(3, 1, "hinge")  # type: ignore[arg-type]


def test_async_merge_mixes_old_and_new() -> None:
    old, new = {"w": torch.tensor([0.0, 4.0])}, {"w": torch.tensor([2.0, 0.0])}
    assert torch.equal(async_merge(old, new, 0.25)["w"], torch.tensor([0.5, 3.0]))
    assert torch.equal(async_merge(old, new, 0.0)["w"], old["w"])
    assert torch.equal(async_merge(old, new, 1.0)["w"], new["w"])
    for alpha in (-0.1, 1.5):
        with pytest.raises(ConfigError):
            async_merge(old, new, alpha)
