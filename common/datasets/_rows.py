"""A person's data as rows of a source, split into training and held-out rows.

Every kind (image folder, arrays, a `datasets` folder, a factory) is a `Source`:
it knows how many rows it has and reads the rows it is asked for, no others, so a
first-stage device opens only the files or rows of its share of each batch. The
split is a list of row numbers, the same on every device because it is a function
of the spec alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from common.data import check_indices
from common.errors import ConfigError
from common.zoo import InputSpec, ZooModel

__all__ = ["RowData", "Source", "Split", "held_out_rows"]


class Source(Protocol):
    """Random access to the rows of one data source; `name` names it in errors."""

    name: str

    def __len__(self) -> int:
        """Rows in the source."""
        ...

    def check(self, want: InputSpec, num_classes: int) -> None:
        """Refuse a model whose input or classes the source cannot give (ConfigError)."""
        ...

    def read(self, rows: list[int], want: InputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs shaped as `want` and their int64 labels, for `rows` only."""
        ...

    def read_labels(self, rows: list[int]) -> torch.Tensor:
        """The int64 labels of `rows` (reading as little as the source allows)."""
        ...


def held_out_rows(size: int, fraction: float, seed: int, name: str) -> tuple[list[int], list[int]]:
    """Training and held-out rows of a source of `size` rows, `fraction` held out.

    A seeded permutation picks the held-out rows; both lists are sorted, so
    rows near each other on disk stay near each other in the list.

    Raises:
        ConfigError: Too few rows to hold one out and keep one for training.

    """
    held = max(1, round(fraction * size))
    if size - held < 1:
        raise ConfigError(
            f"dataset.path: {name} has {size} samples, too few to hold out "
            f"{fraction:g} of them and train on the rest"
        )
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    perm = torch.randperm(size, generator=gen)
    return sorted(perm[held:].tolist()), sorted(perm[:held].tolist())


@dataclass(frozen=True)
class Split:
    """The training and held-out rows of a job's data, known without reading any sample."""

    train: Source
    train_rows: list[int]
    held_out: Source
    held_rows: list[int]

    def datasets(self, model: ZooModel) -> tuple[RowData, RowData]:
        """Both parts as `common.data.Dataset`s shaped for `model` (checked first)."""
        for source in {id(self.train): self.train, id(self.held_out): self.held_out}.values():
            source.check(model.input, model.num_classes)
        return (
            RowData(self.train, self.train_rows, model),
            RowData(self.held_out, self.held_rows, model),
        )


class RowData:
    """Some rows of a source as a `common.data.Dataset`: index i is the i-th of `rows`."""

    def __init__(self, source: Source, rows: list[int], model: ZooModel) -> None:
        self.source, self.input, self.num_classes = source, model.input, model.num_classes
        self._rows = torch.tensor(rows, dtype=torch.int64)

    def __len__(self) -> int:
        return int(self._rows.numel())

    def _rows_of(self, indices: torch.Tensor) -> list[int]:
        rows: list[int] = self._rows[check_indices(indices, len(self))].tolist()
        return rows

    def _checked_labels(self, labels: torch.Tensor, rows: list[int]) -> torch.Tensor:
        bad = (labels < 0) | (labels >= self.num_classes)
        if bool(bad.any()):
            at = int(torch.nonzero(bad)[0, 0])
            raise ConfigError(
                f"dataset: {self.source.name} row {rows[at]} has label {int(labels[at])}, "
                f"the model has classes 0-{self.num_classes - 1}"
            )
        return labels

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(N, *input.shape)`` of the model's dtype and int64 labels ``(N,)``."""
        rows = self._rows_of(indices)
        x, y = self.source.read(rows, self.input)
        want = (len(rows), *self.input.shape)
        if tuple(x.shape) != want or x.dtype != self.input.dtype:
            raise ConfigError(
                f"dataset: {self.source.name} gave inputs {tuple(x.shape)} {x.dtype}, "
                f"the model wants {want} {self.input.dtype}"
            )
        vocab = self.input.vocab_size
        if vocab is not None and x.numel() and not 0 <= int(x.min()) <= int(x.max()) < vocab:
            raise ConfigError(
                f"dataset: {self.source.name} has token ids outside "
                f"[0, {self.input.vocab_size}) (the model's vocab_size)"
            )
        return x, self._checked_labels(y, rows)

    def labels(self, indices: torch.Tensor) -> torch.Tensor:
        """The int64 labels `batch(indices)` would give, without reading inputs where possible."""
        rows = self._rows_of(indices)
        return self._checked_labels(self.source.read_labels(rows), rows)
