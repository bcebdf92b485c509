"""A person's own data: image folders, arrays, `datasets` folders and factories.

`open_split` turns a job's ``dataset`` spec into a `Split`: which rows of which
source train and which are held out, known from names and headers alone (the
coordinator sizes a job with it without reading a sample). `Split.datasets`
then gives the `common.data.Dataset`s the first stage and the reference
trainer read, row by row, only the rows of the batches they make.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from common.datasets._rows import RowData, Source, Split, held_out_rows
from common.datasets.arrays import Arrays
from common.datasets.custom import FactoryRows, data_factory, make_dataset
from common.datasets.hf_folder import HfRows, load_folder
from common.datasets.images import ImageFolder, Normalise
from common.errors import ConfigError
from common.job import ArraysData, CustomData, HfFolderData, ImageFolderData, UserData

__all__ = ["RowData", "Split", "data_factory", "open_split"]


def open_split(spec: UserData, allowed_modules: Collection[str] = ()) -> Split:
    """The checked sources and split rows of `spec` (cached: a job opens it several times).

    `allowed_modules` is the reading service's own ``model_modules`` setting, the
    only thing that lets a ``custom`` factory's module be imported.

    Raises:
        ConfigError: A path is missing or malformed, a factory is refused, or the
            held-out part is larger than ``eval_size`` allows; the message names
            the path (or factory) and what is wrong.

    """
    return _open(spec, frozenset(allowed_modules))


@functools.lru_cache(maxsize=4)
def _open(spec: UserData, allowed: frozenset[str]) -> Split:
    train, held = _sources(spec, allowed)
    if held is None:
        rows, held_rows = held_out_rows(
            len(train), spec.held_out_fraction, spec.split_seed, train.name
        )
        held = train
    else:
        rows, held_rows = list(range(len(train))), list(range(len(held)))
    if spec.eval_size is not None and spec.eval_size > len(held_rows):
        raise ConfigError(
            f"dataset.eval_size: {spec.eval_size} exceeds the {len(held_rows)} held-out "
            f"samples of {held.name}"
        )
    return Split(train, rows, held, held_rows)


def _sources(spec: UserData, allowed: frozenset[str]) -> tuple[Source, Source | None]:
    """The training source of `spec` and its separate held-out source, if it names one."""
    if isinstance(spec, ImageFolderData):
        norm = Normalise(spec.mean, spec.std)
        folder = ImageFolder(spec.path, norm)
        held = None if spec.held_out is None else ImageFolder(spec.held_out, norm, folder.classes)
        return folder, held
    if isinstance(spec, ArraysData):
        return Arrays(spec.path), None if spec.held_out is None else Arrays(spec.held_out)
    if isinstance(spec, HfFolderData):
        norm = Normalise(spec.mean, spec.std)
        ds, held_ds = load_folder(spec.path, spec.split, spec.held_out_split)
        cols = (spec.x_column, spec.label_column, norm)
        rows = HfRows(ds, f"{spec.path} [{spec.split}]", *cols)
        held_rows = (
            None
            if held_ds is None
            else HfRows(held_ds, f"{spec.path} [{spec.held_out_split}]", *cols)
        )
        return rows, held_rows
    if isinstance(spec, CustomData):
        train = FactoryRows(make_dataset(spec.factory, allowed), spec.factory)
        if spec.held_out_factory is None:
            return train, None
        return train, FactoryRows(
            make_dataset(spec.held_out_factory, allowed), spec.held_out_factory
        )
    raise ConfigError(f"dataset.kind {spec!r} is unknown")
