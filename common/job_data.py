"""A job's data as the first stage and the reference trainer see it.

Training samples are addressed by a global position (round x global batch +
offset), so any worker can produce its share without a data server and a
resumed job continues where it stopped. A finite training set is walked in
a fresh order each epoch: position i is sample perm_e[i mod N] of epoch
e = i // N, with perm_e a function of (seed, e). Held-out samples are the
first `eval_size` samples of the held-out split, always in order.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from common.cifar10 import Cifar10Folder, Cifar10Images, check_model, find_folder
from common.data import Dataset, dataset_for, split_indices
from common.datasets import Split, open_split
from common.errors import ConfigError, DataPathError
from common.fl.data import DIGIT_CLASSES, TensorData, home_share, load_digits_split
from common.job import Cifar10Data, CustomData, DigitsData, JobSpec, SyntheticData, UserData
from common.zoo import ZooModel

__all__ = ["JobData", "epoch_order", "eval_size", "open_data", "sample_indices", "train_size"]


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, size: int) -> torch.Tensor:
    """The sample order of `epoch`: a permutation of `size`, a function of (seed, epoch)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(size, generator=gen)


def sample_indices(seed: int, size: int | None, start: int, count: int) -> list[int]:
    """Which training samples positions ``start .. start+count-1`` are (a finite set's indices).

    Unbounded synthetic data has no epochs: a position is its own sample. The
    coordinator's sample ledger records these, without loading any data.
    """
    positions = torch.arange(start, start + count, dtype=torch.int64)
    if size is None:
        return positions.tolist()
    epochs = positions // size
    idx = torch.empty_like(positions)
    for e in torch.unique(epochs).tolist():
        sel = epochs == e
        idx[sel] = epoch_order(seed, int(e), size)[positions[sel] % size]
    return idx.tolist()


class JobData:
    """Training and held-out batches of one job."""

    def __init__(
        self,
        train: Dataset,
        held_out: Dataset,
        train_size: int | None,
        eval_size: int,
        seed: int,
        *,
        synthetic: bool,
    ) -> None:
        self.train, self.held_out = train, held_out
        self.train_size, self.eval_size, self.seed = train_size, eval_size, seed
        self._synthetic = synthetic

    def train_batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training positions ``start .. start+count-1`` as ``(inputs, labels)``."""
        if self.train_size is None:
            return self.train.batch(split_indices("train", start, count))
        idx = torch.tensor(sample_indices(self.seed, self.train_size, start, count))
        if self._synthetic:
            idx = idx + split_indices("train", 0, 1)[0]
        return self.train.batch(idx)

    def eval_batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out samples ``start .. start+count-1`` (wrapping past `eval_size`)."""
        idx = torch.arange(start, start + count, dtype=torch.int64) % self.eval_size
        if self._synthetic:
            idx = idx + split_indices("eval", 0, 1)[0]
        return self.held_out.batch(idx)


def open_data(job: JobSpec, model: ZooModel, allowed_modules: Collection[str] = ()) -> JobData:
    """The data `job.dataset` names, shaped for `model`'s first layer.

    `allowed_modules` is the reading service's own ``model_modules`` setting: only
    it lets a ``custom`` dataset's factory module be imported.

    Raises:
        ConfigError: The data does not fit the model, or its files are missing.

    """
    spec = job.dataset
    if isinstance(spec, SyntheticData):
        data = dataset_for(model, job.seed)
        return JobData(data, data, spec.train_size, spec.eval_size, job.seed, synthetic=True)
    if isinstance(spec, Cifar10Data):
        check_model(model)
        folder = _cifar10_folder(spec)
        train, held_out = Cifar10Images(folder.train), Cifar10Images((folder.test,))
        evals = spec.eval_size or folder.test_records
        return JobData(train, held_out, folder.train_records, evals, job.seed, synthetic=False)
    if isinstance(spec, DigitsData):
        x, y = _digits_share(spec)
        share = TensorData(x, y, DIGIT_CLASSES)
        share.check_model(model, "scikit-learn's digits")
        digits_test = _digits_held_out(spec.split_seed)
        return JobData(share, digits_test, len(y), len(digits_test), job.seed, synthetic=False)
    if isinstance(spec, UserData):
        rows, held_rows = open_split(spec, allowed_modules).datasets(model)
        evals = spec.eval_size or len(held_rows)
        return JobData(rows, held_rows, len(rows), evals, job.seed, synthetic=False)
    raise ConfigError(f"dataset.kind {spec!r} is unknown")


def _digits_share(spec: DigitsData) -> tuple[torch.Tensor, torch.Tensor]:
    return home_share(spec.homes, spec.home, spec.alpha, spec.split_seed, spec.min_size)


@functools.lru_cache(maxsize=2)
def _digits_held_out(seed: int) -> TensorData:
    split = load_digits_split(seed=seed)
    return TensorData(split.test_x, split.test_y, DIGIT_CLASSES)


def train_size(job: JobSpec, allowed_modules: Collection[str] = ()) -> int | None:
    """Training samples of `job` (None: unbounded), without building its model.

    Lets the coordinator check the data and turn `epochs` into rounds when a job
    is submitted, before any device is asked to load anything; a person's own
    data is listed (names and headers), not read.

    Raises:
        DataPathError: The dataset's files are missing or malformed (a ConfigError).
        ConfigError: A ``custom`` dataset's factory is refused or fails.

    """
    spec = job.dataset
    if isinstance(spec, SyntheticData):
        return spec.train_size
    if isinstance(spec, Cifar10Data):
        return _checked_folder(spec).train_records
    if isinstance(spec, DigitsData):
        return len(_digits_share(spec)[1])
    if isinstance(spec, UserData):
        return len(_checked_split(spec, allowed_modules).train_rows)
    raise ConfigError(f"dataset.kind {spec!r} is unknown")


def eval_size(job: JobSpec, allowed_modules: Collection[str] = ()) -> int:
    """Held-out samples one evaluation of `job` covers, without building its model.

    Lets the coordinator size evaluation requests without loading the data.

    Raises:
        DataPathError: The dataset's files are missing or malformed (a ConfigError).
        ConfigError: A ``custom`` dataset's factory is refused or fails.

    """
    spec = job.dataset
    if isinstance(spec, SyntheticData):
        return spec.eval_size
    if isinstance(spec, Cifar10Data):
        folder = _checked_folder(spec)
        return spec.eval_size or folder.test_records
    if isinstance(spec, DigitsData):
        return len(_digits_held_out(spec.split_seed))
    if isinstance(spec, UserData):
        return spec.eval_size or len(_checked_split(spec, allowed_modules).held_rows)
    raise ConfigError(f"dataset.kind {spec!r} is unknown")


def _checked_split(spec: UserData, allowed_modules: Collection[str]) -> Split:
    """`open_split` for a check on the coordinator: a path's failure is a DataPathError.

    A factory's refusal says nothing about the coordinator's disk, so it stays
    a plain ConfigError with its reason.
    """
    if isinstance(spec, CustomData):
        return open_split(spec, allowed_modules)
    try:
        return open_split(spec, allowed_modules)
    except (ConfigError, OSError) as exc:  # OSError: a folder it may not even look into
        raise DataPathError(str(exc)) from None


def _checked_folder(spec: Cifar10Data) -> Cifar10Folder:
    """`_cifar10_folder` for a check on the coordinator: any failure is a DataPathError."""
    try:
        return _cifar10_folder(spec)
    except (ConfigError, OSError) as exc:  # OSError: a folder it may not even look into
        raise DataPathError(str(exc)) from None


def _cifar10_folder(spec: Cifar10Data) -> Cifar10Folder:
    """The checked folder of `spec`, with `eval_size` checked against its held-out file."""
    folder = find_folder(spec.path)
    if spec.eval_size is not None and spec.eval_size > folder.test_records:
        raise ConfigError(
            f"dataset.eval_size: {spec.eval_size} exceeds the {folder.test_records} "
            f"records of {folder.test}"
        )
    return folder
