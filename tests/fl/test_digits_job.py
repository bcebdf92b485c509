"""A job on a home's share of scikit-learn's digits, as the first stage sees it."""

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from common.errors import ConfigError
from common.fl.data import dirichlet_split, home_share, load_digits_split
from common.job import DigitsData, JobSpec
from common.job_data import eval_size, open_data, sample_indices, train_size
from common.zoo import ModelSpec, build_model

HOMES, ALPHA, SPLIT_SEED, MIN_SIZE = 4, 0.5, 3, 10
DIGITS_CNN = {"channels": 1, "size": 8, "width": 16, "hidden": 64}


def job(home: int, seed: int = 0, **options: Any) -> JobSpec:
    data = DigitsData(homes=HOMES, home=home, alpha=ALPHA, split_seed=SPLIT_SEED, min_size=MIN_SIZE)
    model = ModelSpec(name="fl_cnn", num_classes=10, options={**DIGITS_CNN, **options})
    return JobSpec(model=model, dataset=data, seed=seed)


def test_the_home_must_be_one_of_the_homes() -> None:
    with pytest.raises(ValidationError, match="home 4 is not one of the 4 homes"):
        DigitsData(homes=4, home=4)
    with pytest.raises(ValidationError, match="home 2 is not one of the 2 homes"):
        JobSpec.model_validate(
            {"model": {"name": "fl_cnn"}, "dataset": {"kind": "digits", "homes": 2, "home": 2}}
        )
    assert DigitsData(homes=4, home=3).home == 3


@pytest.mark.parametrize("home", range(HOMES))
def test_open_data_gives_the_homes_share_and_the_held_out_part(home: int) -> None:
    spec = job(home)
    data = open_data(spec, build_model(spec.model, spec.seed))
    x, y = home_share(HOMES, home, ALPHA, SPLIT_SEED, MIN_SIZE)
    assert data.train_size == train_size(spec) == len(y) >= MIN_SIZE
    epoch_x, epoch_y = data.train_batch(0, len(y))  # one epoch: the share, reordered
    perm = sample_indices(spec.seed, len(y), 0, len(y))
    assert sorted(perm) == list(range(len(y)))
    assert torch.equal(epoch_x, x[perm]) and torch.equal(epoch_y, y[perm])
    held_out = round(1797 * 0.25)  # digits' 1,797 images, a quarter held out
    assert data.eval_size == eval_size(spec) == held_out == 449
    test = load_digits_split(seed=SPLIT_SEED)
    ex, ey = data.eval_batch(0, held_out)
    assert torch.equal(ex, test.test_x) and torch.equal(ey, test.test_y)


def test_the_shares_partition_the_training_part() -> None:
    split = load_digits_split(seed=SPLIT_SEED)
    parts = dirichlet_split(split.train_y, HOMES, ALPHA, SPLIT_SEED, MIN_SIZE)
    everyone = torch.cat(parts)
    assert len(everyone) == len(split.train_y) == 1797 - 449
    assert torch.equal(torch.sort(everyone).values, torch.arange(len(split.train_y)))  # disjoint
    for home, idx in enumerate(parts):
        x, y = home_share(HOMES, home, ALPHA, SPLIT_SEED, MIN_SIZE)
        assert torch.equal(x, split.train_x[idx]) and torch.equal(y, split.train_y[idx])
    assert sum(train_size(job(h)) or 0 for h in range(HOMES)) == len(split.train_y)


@pytest.mark.parametrize(
    ("options", "num_classes"), [({"channels": 3}, 10), ({"size": 12}, 10), ({}, 9)]
)
def test_a_model_that_does_not_take_digits_is_refused(
    options: dict[str, Any], num_classes: int
) -> None:
    spec = job(0, **options)
    model_spec = spec.model.model_copy(update={"num_classes": num_classes})
    with pytest.raises(ConfigError, match="scikit-learn's digits are images of shape"):
        open_data(spec, build_model(model_spec, 0))


def test_train_batch_walks_the_share_in_the_seeded_order() -> None:
    spec = job(1, seed=7)
    data = open_data(spec, build_model(spec.model, spec.seed))
    x, y = home_share(HOMES, 1, ALPHA, SPLIT_SEED, MIN_SIZE)
    size = len(y)
    start, count = size - 5, 12  # crosses from epoch 0 into epoch 1
    idx = sample_indices(7, size, start, count)
    assert sorted(idx[:5] + sample_indices(7, size, 0, size - 5)) == list(range(size))
    bx, by = data.train_batch(start, count)
    assert torch.equal(bx, x[idx]) and torch.equal(by, y[idx])
    assert sample_indices(8, size, 0, size) != sample_indices(7, size, 0, size)
