"""Datasets made by a ``package.module:factory`` the job names.

Same rules as custom models (`common.zoo.custom`): the module must be in the
reading service's ``model_modules`` setting before anything is imported, and the
attribute must be declared with `data_factory`, so a job cannot call a helper of
an allowed module. The factory takes no arguments and returns a map-style
dataset: ``len(ds)`` and ``ds[i] -> (x, y)`` with ``x`` a tensor (or array) of
the model's input shape and ``y`` an integer. What user code raises becomes a
ConfigError naming the factory.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import numpy as np
import torch

from common.errors import ConfigError
from common.zoo import InputSpec
from common.zoo.custom import allowed_source, import_user_module

__all__ = ["FactoryRows", "data_factory", "make_dataset"]

_F = TypeVar("_F", bound=Callable[[], object])

_FACTORIES: dict[int, Callable[[], object]] = {}
"""Every callable declared with `data_factory`, by identity (and kept alive)."""

_USER_CODE_ERRORS = (Exception, SystemExit, KeyboardInterrupt)


def data_factory(factory: _F) -> _F:
    """Declare ``factory`` a dataset factory that ``dataset.factory`` may name in a job."""
    if not callable(factory):
        raise TypeError(f"data_factory needs a callable, got {type(factory).__name__}")
    _FACTORIES[id(factory)] = factory
    return factory


def make_dataset(name: str, allowed_modules: Collection[str]) -> Any:
    """Import (if allow-listed) and call the factory `name`; return what it made.

    Raises:
        ConfigError: The module is not allow-listed, cannot be imported, the
            attribute is not a declared factory, or the factory fails or returns
            something without ``len`` and ``[i]``.

    """
    module_name, attr = allowed_source("dataset.factory", name, allowed_modules)
    module = import_user_module(f"dataset.factory {name!r}", module_name)
    factory: Callable[[], object] | None = vars(module).get(attr)
    if factory is None or _FACTORIES.get(id(factory)) is not factory:
        raise ConfigError(
            f"dataset.factory {name!r}: {attr!r} in {module_name!r} is not declared a dataset "
            "factory (decorate it with common.datasets.data_factory); nothing was called"
        )
    try:
        ds: Any = factory()
        size = len(ds)
    except _USER_CODE_ERRORS as exc:
        raise ConfigError(f"dataset.factory {name!r}: factory raised {exc!r}") from exc
    if not isinstance(size, int) or size < 1 or not hasattr(ds, "__getitem__"):
        raise ConfigError(
            f"dataset.factory {name!r}: the factory must return a non-empty map-style "
            f"dataset (len and [i]), got {type(ds).__name__}"
        )
    return ds


class FactoryRows:
    """A factory's map-style dataset as a source; ``ds[i]`` is called for the rows read."""

    def __init__(self, ds: Any, name: str) -> None:
        self.ds, self.name = ds, name
        self._size = len(ds)

    def __len__(self) -> int:
        return self._size

    def check(self, want: InputSpec, num_classes: int) -> None:
        """Nothing to check before reading: every batch is checked as it is read."""

    def _item(self, row: int) -> tuple[torch.Tensor, int]:
        try:
            x, y = self.ds[row]
            return torch.as_tensor(np.asarray(x)), int(y)
        except _USER_CODE_ERRORS as exc:
            raise ConfigError(f"dataset.factory {self.name!r}: item {row} raised {exc!r}") from exc

    def read(self, rows: list[int], want: InputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of `rows` shaped for `want`, and their labels; no other row is read."""
        items = [self._item(r) for r in rows]
        for row, (x, _) in zip(rows, items, strict=True):
            if tuple(x.shape) != want.shape:
                raise ConfigError(
                    f"dataset.factory {self.name!r}: item {row} has x of shape "
                    f"{tuple(x.shape)}, the model's input is {want.shape}"
                )
        x = torch.stack([x for x, _ in items]) if items else torch.empty(0, *want.shape)
        return x.to(want.dtype), torch.tensor([y for _, y in items], dtype=torch.int64)

    def read_labels(self, rows: list[int]) -> torch.Tensor:
        """The int64 labels of `rows`."""
        return torch.tensor([self._item(r)[1] for r in rows], dtype=torch.int64)
