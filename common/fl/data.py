"""Real, small, non-IID federated data: scikit-learn's digits split across homes.

The digits set (1,797 8x8 images, shipped inside scikit-learn) needs no download, so
federated runs and their tests use real images offline; `dirichlet_split` gives each
home the label skew FL papers evaluate with (per class, shares ~ Dir(alpha)).
"""

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.errors import ConfigError
from common.extras import require
from common.zoo import InputSpec, ZooModel

__all__ = [
    "DIGIT_CLASSES",
    "DigitsSplit",
    "TensorData",
    "dirichlet_split",
    "home_share",
    "label_histogram",
    "load_digits_split",
]

DIGIT_CLASSES = 10
_MAX_PIXEL = 16.0  # digits' pixels are counts 0..16 of a 4x4 block
_MAX_DRAWS = 1000


@dataclass(frozen=True)
class DigitsSplit:
    """Digits as float images in [0, 1], shape ``(N, 1, 8, 8)``, and int64 labels.

    Attributes:
        train_x: Images the homes train on.
        train_y: Their labels.
        test_x: Held-out images the server evaluates the global model on.
        test_y: Their labels.

    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> DigitsSplit:
    """Load digits and split them at random (seeded) into training and held-out parts.

    Raises:
        ConfigError: If ``test_fraction`` is not in (0, 1).

    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    load_digits = require("sklearn.datasets", "the digits data set").load_digits

    bunch = load_digits()
    images = torch.tensor(np.asarray(bunch.images), dtype=torch.float32) / _MAX_PIXEL
    x = images.unsqueeze(1)
    y = torch.tensor(np.asarray(bunch.target), dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return DigitsSplit(x[train], y[train], x[test], y[test])


@functools.lru_cache(maxsize=4)
def home_share(
    homes: int, home: int, alpha: float, seed: int, min_size: int
) -> tuple[Tensor, Tensor]:
    """One home's Dirichlet share of the digits training part: ``(images, labels)``.

    Every device of a home (and the simulator) computes the same share from the
    same seeds, so a home's samples never travel; cached because every assignment
    of a job asks again.

    Raises:
        ConfigError: As `dirichlet_split`, or ``home`` not in ``[0, homes)``.

    """
    if not 0 <= home < homes:
        raise ConfigError(f"home must be in [0, {homes}), got {home}")
    data = load_digits_split(seed=seed)
    mine = dirichlet_split(data.train_y, homes, alpha, seed, min_size)[home]
    return data.train_x[mine], data.train_y[mine]


class TensorData:
    """Samples held as two tensors; the `common.data.Dataset` of in-memory real data."""

    def __init__(self, x: Tensor, y: Tensor, num_classes: int) -> None:
        if len(x) != len(y) or not len(y):
            raise ConfigError(f"need as many labels as samples (> 0), got {len(x)} and {len(y)}")
        self.x, self.y = x, y
        self.input = InputSpec(kind="image", shape=tuple(x.shape[1:]), dtype=x.dtype)
        self.num_classes = num_classes

    def check_model(self, model: ZooModel, what: str) -> None:
        """ConfigError unless `model` takes these samples and predicts these classes."""
        if model.input != self.input or model.num_classes != self.num_classes:
            raise ConfigError(
                f"the model takes {model.input.kind} input of shape {model.input.shape} in "
                f"{model.num_classes} classes; {what} are images of shape {self.input.shape} "
                f"in {self.num_classes} classes"
            )

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Samples and labels at ``indices``."""
        return self.x[indices], self.y[indices]

    def labels(self, indices: Tensor) -> Tensor:
        """Labels at ``indices``."""
        return self.y[indices]


def label_histogram(labels: Tensor, classes: int) -> tuple[int, ...]:
    """Count the samples of each class; what a home reports instead of its samples.

    Raises:
        ConfigError: If a label is outside ``[0, classes)``.

    """
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ConfigError(
            f"labels must lie in [0, {classes}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return tuple(int(c) for c in torch.bincount(labels.long(), minlength=classes))


def dirichlet_split(
    labels: Tensor, homes: int, alpha: float, seed: int, min_size: int = 1
) -> list[Tensor]:
    """Split sample indices over homes with label skew: per class, shares ~ Dir(alpha).

    Small ``alpha`` gives each class to few homes; large ``alpha`` approaches an IID
    split. Every sample goes to exactly one home; draws are repeated (as NIID-Bench
    does) until every home holds at least ``min_size`` samples.

    Returns:
        One sorted int64 index tensor per home.

    Raises:
        ConfigError: Bad ``homes``/``alpha``/``min_size``, too few samples, or no draw
            in 1000 met ``min_size``.

    """
    n = int(labels.numel())
    if homes < 1 or not alpha > 0 or min_size < 0:
        raise ConfigError(
            f"need homes >= 1, alpha > 0, min_size >= 0; got {homes}, {alpha}, {min_size}"
        )
    if n < homes * min_size:
        raise ConfigError(
            f"{homes} homes of >= {min_size} samples need {homes * min_size}, got {n}"
        )
    rng = np.random.default_rng(seed)
    y = labels.cpu().numpy()
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
    for _ in range(_MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(homes)]
        for idx in by_class:
            shares = rng.dirichlet(np.full(homes, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
            for home, chunk in enumerate(np.split(idx, cuts)):
                parts[home].append(chunk)
        sizes = [sum(len(c) for c in p) for p in parts]
        if min(sizes) >= min_size:
            return [torch.from_numpy(np.sort(np.concatenate(p))).long() for p in parts]
    raise ConfigError(
        f"no Dir({alpha}) split of {n} samples over {homes} homes gave every home "
        f">= {min_size} samples in {_MAX_DRAWS} draws; raise alpha or lower min_size"
    )
