"""CIFAR-10 read from a local folder in its binary format.

Each file is a run of 3073-byte records: one label byte (0-9), then 1024 red,
1024 green and 1024 blue bytes of a row-major 32x32 image. The records are
read once into one uint8 tensor, so a batch is a gather and a table lookup
rather than a Python loop over samples. Layout problems are reported against
the job field `dataset.path` so that a bad folder stops a job at submission,
before any device loads data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.data import check_indices
from common.errors import ConfigError
from common.zoo import InputSpec, ZooModel

__all__ = [
    "CIFAR10_INPUT",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "NUM_CLASSES",
    "RECORD_BYTES",
    "Cifar10Folder",
    "Cifar10Images",
    "check_model",
    "find_folder",
]

NUM_CLASSES = 10
_PIXELS = 32 * 32
RECORD_BYTES = 1 + 3 * _PIXELS
"""One label byte and 3072 pixel bytes."""

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel (red, green, blue) mean of the training images, pixels scaled to [0, 1]."""
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the training images, pixels scaled to [0, 1]."""

CIFAR10_INPUT = InputSpec(kind="image", shape=(3, 32, 32), dtype=torch.float32)
"""What one CIFAR-10 sample looks like to a model's first layer."""

_TRAIN_GLOB = "data_batch_*.bin"
_TEST_NAME = "test_batch.bin"


@dataclass(frozen=True)
class Cifar10Folder:
    """The files of a CIFAR-10 folder and their record counts, checked by `find_folder`.

    Attributes:
        train: The training files, sorted by name.
        test: The held-out file.
        train_records: Records in all training files together.
        test_records: Records in the held-out file.

    """

    train: tuple[Path, ...]
    test: Path
    train_records: int
    test_records: int


def _records_in(path: Path) -> int:
    """Number of records in `path`, from its size alone."""
    size = path.stat().st_size
    if size % RECORD_BYTES:
        raise ConfigError(
            f"dataset.path: {path} has {size} bytes, not a multiple of the "
            f"{RECORD_BYTES}-byte record (1 label byte + 3072 pixel bytes)"
        )
    if size == 0:
        raise ConfigError(f"dataset.path: {path} is empty, expected at least one record")
    return size // RECORD_BYTES


def find_folder(path: Path) -> Cifar10Folder:
    """Check a CIFAR-10 folder's layout and file sizes without reading the records.

    Cheap enough for the coordinator to call at submission, so a missing or
    truncated file fails the job before any worker starts.

    Raises:
        ConfigError: The folder, its training files or `test_batch.bin` is missing,
            or a file's size is not a whole number of records.

    """
    if not path.is_dir():
        raise ConfigError(f"dataset.path: folder {path} does not exist")
    train = tuple(sorted(p for p in path.glob(_TRAIN_GLOB) if p.is_file()))
    if not train:
        raise ConfigError(f"dataset.path: no {_TRAIN_GLOB} (training files) in {path}")
    test = path / _TEST_NAME
    if not test.is_file():
        raise ConfigError(f"dataset.path: {path} has no {_TEST_NAME} (held-out file)")
    train_records = sum(_records_in(p) for p in train)
    return Cifar10Folder(train, test, train_records, _records_in(test))


def check_model(model: ZooModel) -> None:
    """Refuse a model that cannot eat CIFAR-10 batches or emits the wrong number of logits.

    Raises:
        ConfigError: The model does not take float32 (3, 32, 32) images or has
            a number of classes other than 10.

    """
    want = model.input
    if want != CIFAR10_INPUT or model.num_classes != NUM_CLASSES:
        raise ConfigError(
            f"dataset.kind cifar10 gives {CIFAR10_INPUT.dtype} images of shape "
            f"{CIFAR10_INPUT.shape} in {NUM_CLASSES} classes; the model wants "
            f"{want.kind} input of {want.dtype}, shape {want.shape}, "
            f"in {model.num_classes} classes"
        )


def _read_records(files: Sequence[Path]) -> torch.Tensor:
    """All records of `files`, in order, as one ``(N, RECORD_BYTES)`` uint8 tensor."""
    counts = [_records_in(p) for p in files]
    records = torch.empty(sum(counts), RECORD_BYTES, dtype=torch.uint8)
    flat = records.view(-1)
    offset = 0
    for path, count in zip(files, counts, strict=True):
        size = count * RECORD_BYTES
        try:
            data = np.fromfile(path, dtype=np.uint8)
        except OSError as exc:
            raise ConfigError(f"dataset.path: cannot read {path}: {exc}") from exc
        if data.size != size:
            raise ConfigError(f"dataset.path: read {data.size} of {size} bytes of {path}")
        flat[offset : offset + size] = torch.from_numpy(data)
        offset += size
    labels = records[:, 0]
    bad = torch.nonzero(labels >= NUM_CLASSES)
    if bad.numel():
        first = int(bad[0, 0])
        ends = torch.tensor(counts).cumsum(0)
        which = int(torch.searchsorted(ends, first, right=True))
        record = first - (int(ends[which - 1]) if which else 0)
        raise ConfigError(
            f"dataset.path: {files[which]} record {record} has label {int(labels[first])}, "
            f"expected 0-{NUM_CLASSES - 1}"
        )
    return records


def _pixel_table() -> torch.Tensor:
    """``table[c, v]``: the normalised float32 value of byte `v` in channel `c`.

    Computed in float64 and rounded once, so each value is the correctly rounded
    ``(v / 255 - mean) / std`` and a batch is a lookup instead of arithmetic.
    """
    values = torch.arange(256, dtype=torch.float64) / 255
    mean = torch.tensor(CIFAR10_MEAN, dtype=torch.float64).unsqueeze(1)
    std = torch.tensor(CIFAR10_STD, dtype=torch.float64).unsqueeze(1)
    return ((values - mean) / std).to(torch.float32)


class Cifar10Images:
    """The records of some CIFAR-10 files as a `Dataset`; index i is the i-th record.

    Files are concatenated in the given order. Images are normalised per channel
    with the usual CIFAR-10 mean and standard deviation.
    """

    def __init__(self, files: Sequence[Path]) -> None:
        if not files:
            raise ConfigError("dataset.path: no CIFAR-10 files given")
        self.input = CIFAR10_INPUT
        self.num_classes = NUM_CLASSES
        self._records = _read_records(files)
        self._labels = self._records[:, 0].to(torch.int64)
        self._table = _pixel_table()
        self._channels = torch.arange(3).view(3, 1)

    def __len__(self) -> int:
        return int(self._records.shape[0])

    def _check(self, indices: torch.Tensor) -> torch.Tensor:
        return check_indices(indices, len(self))

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return float32 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``."""
        indices = self._check(indices)
        pixels = self._records[indices, 1:].view(-1, 3, _PIXELS).to(torch.int64)
        images = self._table[self._channels, pixels]
        return images.view(-1, *CIFAR10_INPUT.shape), self._labels[indices]

    def labels(self, indices: torch.Tensor) -> torch.Tensor:
        """Return only the int64 labels of `indices`, without building images."""
        return self._labels[self._check(indices)]
