"""The model zoo: named models exposed as ordered lists of placeable layers.

Each layer maps one tensor to one tensor, so a contiguous slice of layers (a stage)
can run on any device; `build_model` is deterministic in ``(spec, seed)`` so that every
worker constructs identical initial weights without shipping them.

Naming, checking and sizing a model need no torch, so importing this package does
not import it: the CLI and the gateway read and check jobs without paying for it.
`InputSpec` and `ZooModel` (types of a built model) load torch on first use, and
`build_model` when it builds.
"""

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from common.zoo._sizes import model_names, parameter_count
from common.zoo._types import ModelSpec, OptionValue
from common.zoo.custom import check_model_source, model_factory

if TYPE_CHECKING:
    from common.zoo._model import InputSpec, ZooModel

__all__ = [
    "InputSpec",
    "ModelSpec",
    "OptionValue",
    "ZooModel",
    "build_model",
    "model_factory",
    "model_names",
    "parameter_count",
]

_TORCH_TYPES = frozenset({"InputSpec", "ZooModel"})


def __getattr__(name: str) -> Any:
    """The types of a built model, imported (with torch) when first asked for."""
    if name in _TORCH_TYPES:
        from common.zoo import _model

        return getattr(_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(spec: ModelSpec, seed: int, allowed_modules: Collection[str] = ()) -> "ZooModel":
    """Build the model a spec names, with weights that depend only on ``(spec, seed)``.

    A ``module:factory`` name imports and runs code, so it is built only when its
    module is in `allowed_modules`, which callers take from their service's own
    ``model_modules`` setting, never from the job; the default allows zoo names only.
    The global torch RNG is seeded inside `torch.random.fork_rng`, so the caller's
    RNG stream is left as it was.

    Raises:
        ConfigError: Unknown model name, a module that is not allowed, bad options,
            bad ``num_classes`` or ``seed``, or anything the user's factory raised.

    """
    from common.zoo import _registry  # torch and every model's layers, only to build

    check_model_source(spec.name, allowed_modules)
    return _registry.build_model(spec, seed)
