"""A Hugging Face `datasets` folder written by ``save_to_disk`` (the ``data`` extra).

``load_from_disk`` memory-maps the folder's Arrow files, so a batch reads only its
rows. An image column (the `datasets` Image feature) is decoded like an image
folder (`common.datasets.images.to_input`); any other input column must hold
arrays of the model's input shape. Labels are one integer column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.datasets.images import Normalise, check_image_model, to_input
from common.errors import ConfigError
from common.extras import require
from common.zoo import InputSpec

__all__ = ["HfRows", "load_folder"]


def load_folder(path: Path, split: str, held_out_split: str | None) -> tuple[Any, Any | None]:
    """The training `datasets.Dataset` of the folder and the held-out one (None: none named).

    Raises:
        ConfigError: No such folder, not a saved dataset, or a split it does not have.

    """
    datasets = require("datasets", "dataset.kind hf_folder")
    if not path.is_dir():
        raise ConfigError(f"dataset.path: folder {path} does not exist")
    try:
        saved = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError(
            f"dataset.path: {path} is not a folder written by save_to_disk: {exc}"
        ) from exc
    if isinstance(saved, datasets.DatasetDict):
        names = sorted(saved)
        for want in (split, held_out_split):
            if want is not None and want not in saved:
                raise ConfigError(f"dataset.path: {path} has no split {want!r} (has {names})")
        return saved[split], None if held_out_split is None else saved[held_out_split]
    if held_out_split is not None:
        raise ConfigError(
            f"dataset.held_out_split: {path} holds one Dataset, not a DatasetDict of splits"
        )
    return saved, None


class HfRows:
    """One `datasets.Dataset` as a source of (input column, label column) rows."""

    def __init__(self, ds: Any, name: str, x_column: str, label_column: str, norm: Normalise):
        self.name, self.norm = name, norm
        missing = [c for c in (x_column, label_column) if c not in ds.column_names]
        if missing:
            raise ConfigError(
                f"dataset.path: {name} has no column {missing[0]!r} (has {ds.column_names[:8]})"
            )
        if len(ds) == 0:
            raise ConfigError(f"dataset.path: {name} holds no rows")
        datasets = require("datasets", "dataset.kind hf_folder")
        feature = ds.features[x_column]
        self.images = isinstance(feature, datasets.Image)
        self._x = ds.select_columns([x_column])
        self._x_column = x_column
        labels = np.asarray(ds.select_columns([label_column]).with_format("numpy")[label_column])
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise ConfigError(
                f"dataset.label_column: {name} column {label_column!r} is not one integer a row"
            )
        self._labels = torch.from_numpy(labels.astype(np.int64))
        self._classes = int(self._labels.max()) + 1

    def __len__(self) -> int:
        return int(self._labels.numel())

    def check(self, want: InputSpec, num_classes: int) -> None:
        """Refuse a model whose input or classes this source cannot give."""
        if self.images:
            check_image_model(want, num_classes, 0, self.name)
            self.norm.per_channel(want.shape[0], self.norm.mean, "mean")
            self.norm.per_channel(want.shape[0], self.norm.std, "std")
        if int(self._labels.min()) < 0 or self._classes > num_classes:
            raise ConfigError(
                f"dataset: {self.name}: labels span [{int(self._labels.min())}, "
                f"{self._classes - 1}], the model has classes 0-{num_classes - 1}"
            )

    def read(self, rows: list[int], want: InputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of `rows` shaped for `want`, and their labels; no other row is read."""
        values = self._x[rows][self._x_column]
        if self.images:
            x = to_input(values, want, self.norm)
        else:
            arr = np.asarray(values)
            if arr.shape[1:] != want.shape:
                raise ConfigError(
                    f"dataset: {self.name} column {self._x_column!r} has rows of shape "
                    f"{arr.shape[1:]}, the model's input is {want.shape}"
                )
            x = torch.from_numpy(np.ascontiguousarray(arr)).to(want.dtype)
        return x, self.read_labels(rows)

    def read_labels(self, rows: list[int]) -> torch.Tensor:
        """The int64 labels of `rows`."""
        return self._labels[torch.tensor(rows, dtype=torch.int64)]
