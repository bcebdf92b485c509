"""Building a user model named ``"package.module:factory"`` (`common.zoo.custom`).

The names, the allow-list and the input options are checked without torch in
`common.zoo.custom`; here the factory runs and what it returns becomes a `ZooModel`.
"""

import torch
from torch import nn

from common.errors import ConfigError
from common.zoo._model import InputSpec, ZooModel, has_batchnorm
from common.zoo._types import ModelSpec
from common.zoo.custom import USER_CODE_ERRORS, input_options, load_factory

__all__ = ["build_custom"]


def _input_spec(spec: ModelSpec) -> InputSpec:
    kind, shape, vocab_size = input_options(spec)
    dtype = torch.float32 if kind == "image" else torch.int64
    return InputSpec(kind=kind, shape=shape, dtype=dtype, vocab_size=vocab_size)


def _check_no_shared_parameters(spec: ModelSpec, layers: list[nn.Module]) -> None:
    """Reject tied weights across layers: two stages cannot both own one tensor."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ConfigError(
                    f"custom model {spec.name!r}: layers {j} and {i} share a parameter; "
                    "each layer must own its parameters so layers can live on different devices"
                )


def _as_layers(result: object) -> list[nn.Module] | None:
    """Return the layers of a Sequential or a sequence of modules, else None."""
    if isinstance(result, nn.Sequential):
        return list(result)
    if isinstance(result, list | tuple) and all(isinstance(m, nn.Module) for m in result):
        return list(result)
    return None


def build_custom(spec: ModelSpec) -> ZooModel:
    """Import and call the factory named by ``spec.name`` and wrap what it returns.

    The caller has already checked the module against the allow-list
    (`check_model_source`); everything user code raises while it is imported, called
    or its result inspected comes out as a ConfigError.

    Raises:
        ConfigError: The module or factory cannot be loaded, the factory fails, or it
            returns something other than a ZooModel, an nn.Sequential or a non-empty
            list/tuple of modules.

    """
    input_spec = _input_spec(spec)  # option errors surface before user code runs
    factory = load_factory(spec)
    try:
        result = factory()
        return _wrap(spec, input_spec, result)
    except ConfigError:
        raise
    except USER_CODE_ERRORS as exc:  # the factory is user code; name the spec that ran it
        raise ConfigError(f"custom model {spec.name!r}: factory raised {exc!r}") from exc


def _wrap(spec: ModelSpec, input_spec: InputSpec, result: object) -> ZooModel:
    """The ZooModel for what a factory returned; its modules' methods are user code too."""
    if isinstance(result, ZooModel):
        if spec.options:
            raise ConfigError(
                f"custom model {spec.name!r}: factory returned a ZooModel, which describes "
                f"its own input, so options must be empty, got {sorted(spec.options)}"
            )
        if result.num_classes != spec.num_classes:
            raise ConfigError(
                f"custom model {spec.name!r}: num_classes is {spec.num_classes} but the "
                f"factory's model has {result.num_classes}"
            )
        _check_no_shared_parameters(spec, result.layers)
        return result

    layers = _as_layers(result)
    if layers is None:
        raise ConfigError(
            f"custom model {spec.name!r}: factory must return a ZooModel, an nn.Sequential "
            f"or a list/tuple of nn.Module, got {type(result).__name__}"
        )
    if not layers:
        raise ConfigError(f"custom model {spec.name!r}: factory returned no layers")
    _check_no_shared_parameters(spec, layers)
    return ZooModel(layers, input_spec, spec.num_classes, has_batchnorm(layers))
