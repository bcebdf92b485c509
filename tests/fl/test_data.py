import pytest
import torch

from common.errors import ConfigError
from common.fl.data import DigitsSplit, dirichlet_split, label_histogram, load_digits_split


@pytest.fixture(scope="module")
def digits() -> DigitsSplit:
    return load_digits_split(test_fraction=0.25, seed=0)


def shares(labels: torch.Tensor, classes: int) -> torch.Tensor:
    counts = torch.tensor(label_histogram(labels, classes), dtype=torch.float64)
    return counts / counts.sum()


def test_digits_are_scaled_one_channel_images(digits: DigitsSplit) -> None:
    assert digits.train_x.shape == (1348, 1, 8, 8)
    assert digits.test_x.shape == (449, 1, 8, 8)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert digits.train_x.min() == 0.0 and digits.train_x.max() == 1.0
    both = torch.cat([digits.train_y, digits.test_y])
    # the split partitions the 1,797 samples: every class keeps its total
    assert label_histogram(both, 10) == (178, 182, 177, 183, 181, 182, 181, 179, 174, 180)


def test_digits_split_depends_only_on_the_seed(digits: DigitsSplit) -> None:
    again = load_digits_split(test_fraction=0.25, seed=0)
    other = load_digits_split(test_fraction=0.25, seed=1)
    assert torch.equal(again.test_x, digits.test_x)
    assert not torch.equal(other.test_x, digits.test_x)
    with pytest.raises(ConfigError):
        load_digits_split(test_fraction=1.0)


def test_label_histogram_counts_by_hand() -> None:
    assert label_histogram(torch.tensor([0, 2, 2, 1]), 4) == (1, 1, 2, 0)
    assert label_histogram(torch.tensor([], dtype=torch.int64), 2) == (0, 0)
    with pytest.raises(ConfigError, match=r"\[0, 3\)"):
        label_histogram(torch.tensor([0, 3]), 3)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_split_uses_every_sample_once(digits: DigitsSplit, alpha: float) -> None:
    parts = dirichlet_split(digits.train_y, 10, alpha, seed=3, min_size=5)
    assert len(parts) == 10
    assert all(len(p) >= 5 for p in parts)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(len(digits.train_y)))
    again = dirichlet_split(digits.train_y, 10, alpha, seed=3, min_size=5)
    assert all(torch.equal(p, q) for p, q in zip(parts, again, strict=True))


def test_small_alpha_skews_labels_and_large_alpha_does_not(digits: DigitsSplit) -> None:
    y = digits.train_y
    overall = shares(y, 10)

    def mean_gap(alpha: float) -> float:
        parts = dirichlet_split(y, 8, alpha, seed=0)
        gaps = [float((shares(y[p], 10) - overall).abs().sum()) for p in parts]
        return sum(gaps) / len(gaps)

    def mean_top_share(alpha: float) -> float:
        parts = dirichlet_split(y, 8, alpha, seed=0)
        return sum(float(shares(y[p], 10).max()) for p in parts) / len(parts)

    assert mean_gap(0.05) > 1.0  # L1 in [0, 2]: homes hold few classes
    assert mean_top_share(0.05) > 0.5
    assert mean_gap(1000.0) < 0.25  # near the global mix
    assert mean_top_share(1000.0) < 0.15


def test_dirichlet_split_rejects_impossible_requests() -> None:
    y = torch.arange(10) % 2
    with pytest.raises(ConfigError):
        dirichlet_split(y, 0, 1.0, seed=0)
    with pytest.raises(ConfigError):
        dirichlet_split(y, 2, 0.0, seed=0)
    with pytest.raises(ConfigError, match="need 12, got 10"):
        dirichlet_split(y, 3, 1.0, seed=0, min_size=4)
    with pytest.raises(ConfigError, match="draws"):
        dirichlet_split(y, 5, 0.001, seed=0, min_size=2)
