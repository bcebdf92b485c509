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

import torch

from common.data import Dataset, dataset_for, split_indices
from common.errors import ConfigError
from common.job import Cifar10Data, JobSpec, SyntheticData
from common.zoo import ZooModel

__all__ = ["JobData", "open_data"]


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
        positions = torch.arange(start, start + count, dtype=torch.int64)
        if self.train_size is None:
            return self.train.batch(split_indices("train", start, count))
        n = self.train_size
        epochs = positions // n
        idx = torch.empty_like(positions)
        for e in torch.unique(epochs).tolist():
            sel = epochs == e
            idx[sel] = self._order(int(e))[positions[sel] % n]
        if self._synthetic:
            idx = idx + split_indices("train", 0, 1)[0]
        return self.train.batch(idx)

    def eval_batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out samples ``start .. start+count-1`` (wrapping past `eval_size`)."""
        idx = torch.arange(start, start + count, dtype=torch.int64) % self.eval_size
        if self._synthetic:
            idx = idx + split_indices("eval", 0, 1)[0]
        return self.held_out.batch(idx)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a few epochs' orders per JobData
    def _order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
        assert self.train_size is not None
        return torch.randperm(self.train_size, generator=gen)


def open_data(job: JobSpec, model: ZooModel) -> JobData:
    """The data `job.dataset` names, shaped for `model`'s first layer.

    Raises:
        ConfigError: The data does not fit the model, or its files are missing.

    """
    spec = job.dataset
    if isinstance(spec, SyntheticData):
        data = dataset_for(model, job.seed)
        return JobData(data, data, spec.train_size, spec.eval_size, job.seed, synthetic=True)
    if isinstance(spec, Cifar10Data):
        raise ConfigError("dataset.kind cifar10 is not available yet")
    raise ConfigError(f"dataset.kind {spec!r} is unknown")
