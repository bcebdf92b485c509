"""The flat tensors a config implies, by name and shape, and the check that weights match.

Kept apart from the converters (`weights`, `llama`) so that each of them, and
the model and the folder reader, checks against one list.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig, layer_key

__all__ = ["check_weights", "expected_shapes", "take"]


def expected_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `config` needs, by name, with its shape (its options decide which)."""
    h, f, kv = config.hidden, config.ffn, config.kv_hidden
    shapes: dict[str, tuple[int, ...]] = {"embed.token": (config.vocab_size, h)}
    if config.positions == "absolute":
        shapes["embed.position"] = (config.max_positions, h)
    norms = ["embed.norm"] if config.kind == "encoder" else ["final_norm"]
    mlp = ("gate", "up") if config.activation == "swiglu" else ("up",)
    for i in range(config.layers):
        for name, rows, bias in (
            ("q", h, config.qkv_bias),
            ("k", kv, config.qkv_bias),
            ("v", kv, config.qkv_bias),
            ("o", h, config.o_bias),
        ):
            shapes[layer_key(i, f"{name}.weight")] = (rows, h)
            if bias:
                shapes[layer_key(i, f"{name}.bias")] = (rows,)
        for name in mlp:
            shapes[layer_key(i, f"{name}.weight")] = (f, h)
            if config.mlp_bias:
                shapes[layer_key(i, f"{name}.bias")] = (f,)
        shapes[layer_key(i, "down.weight")] = (h, f)
        if config.mlp_bias:
            shapes[layer_key(i, "down.bias")] = (h,)
        norms += [layer_key(i, "ln1"), layer_key(i, "ln2")]
    for prefix in norms:
        shapes[f"{prefix}.weight"] = (h,)
        if config.norm == "layer":
            shapes[f"{prefix}.bias"] = (h,)
    if not config.tied_head:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.num_classes:
        shapes["pool.weight"], shapes["pool.bias"] = (h, h), (h,)
        shapes["classify.weight"] = (config.num_classes, h)
        shapes["classify.bias"] = (config.num_classes,)
    return shapes


def check_weights(config: TransformerConfig, w: Mapping[str, Tensor]) -> None:
    """Refuse weights that lack a tensor `config` needs or hold one of another shape.

    Raises:
        ConfigError: Naming the first missing or misshapen tensor, expected vs actual.

    """
    for name, shape in expected_shapes(config).items():
        if name not in w:
            raise ConfigError(f"weights lack tensor {name!r} of shape {shape}")
        if tuple(w[name].shape) != shape:
            raise ConfigError(
                f"tensor {name!r} must have shape {shape} for hidden {config.hidden}, "
                f"heads {config.heads}, ffn {config.ffn}; got {tuple(w[name].shape)}"
            )


def take(sd: Mapping[str, Tensor], key: str) -> Tensor:
    """A float32 copy of state-dict tensor `key`; ConfigError naming it when absent."""
    if key not in sd:
        raise ConfigError(f"model lacks tensor {key!r}")
    return sd[key].detach().clone().float()
