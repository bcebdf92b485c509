"""Import a package of the ``data`` extra, or say in one line how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

from common.errors import ConfigError

__all__ = ["need"]


def need(module: str, kind: str) -> ModuleType:
    """`module` imported, or a ConfigError naming the dataset kind and the extra.

    Pillow and `datasets` are heavy and a device that trains on its own arrays
    never needs them, so they are imported only when a job's data asks for them.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"dataset.kind {kind} needs {module.partition('.')[0]}, which is not installed: "
            f"pip install 'asteroid-edge[data]' ({exc})"
        ) from None
