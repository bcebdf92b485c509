"""The single-device reference Transformer, built only from `blocks`.

Distributed Galaxy inference must reproduce these numbers, so this module
composes the very pieces the executor splits, with the full head and column
ranges: any disagreement is then a bug in the splitting, not in the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy import blocks
from services.lib.galaxy.weights import expected_shapes

__all__ = [
    "KVCache",
    "forward",
    "generate",
    "init_tensor",
    "init_weights",
    "weight_bytes",
]

_INIT_STD = 0.02  # BERT's and GPT-2's initializer range
_FLOAT32_BYTES = 4


class KVCache:
    """Keys and values already computed for a decoder, per layer `(len(kv_heads), t, d)`.

    A device that owns only some heads caches only their KV groups (`kv_heads`),
    which is how the per-device memory of the KV cache shrinks with tensor
    parallelism; under grouped-query attention it is smaller still. Keys are
    cached rotated (rotary positions), so a cached position is never turned again.
    """

    def __init__(self, config: TransformerConfig, heads: range | None = None) -> None:
        """Start empty for `config`'s layers and query heads `heads` (all by default).

        Raises:
            ConfigError: If the model is an encoder (bidirectional attention leaves
                nothing to reuse), or `heads` is not a step-1 range of its heads made
                of whole KV groups. It may be empty: a device without heads still
                counts the positions cached (its tensors have no heads).

        """
        if config.kind != "decoder":
            raise ConfigError(f"a KV cache needs a causal decoder, got a {config.kind}")
        heads = range(config.heads) if heads is None else heads
        if heads.step != 1 or heads.start < 0 or heads.stop > config.heads:
            raise ConfigError(
                f"cache heads must be a step-1 range within [0, {config.heads}), got {heads}"
            )
        self.config = config
        self.heads = heads
        self.kv_heads = config.kv_range(heads)
        self._k: list[Tensor | None] = [None] * config.layers
        self._v: list[Tensor | None] = [None] * config.layers

    @property
    def length(self) -> int:
        """Positions cached in every layer: the position of the next token."""
        last = self._k[-1]
        return 0 if last is None else last.shape[1]

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new positions' `k`, `v` to layer `layer`; return all cached keys and values.

        Raises:
            ConfigError: If the layer is out of range or the shapes do not match the
                cached heads.

        """
        if not 0 <= layer < self.config.layers:
            raise ConfigError(f"layer must be in [0, {self.config.layers}), got {layer}")
        want = (len(self.kv_heads), self.config.head_dim)
        if k.shape != v.shape or k.dim() != 3 or (k.shape[0], k.shape[2]) != want:
            raise ConfigError(
                f"cache of layer {layer} takes k, v of shape ({want[0]}, t, {want[1]}), got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        old_k, old_v = self._k[layer], self._v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
        self._k[layer], self._v[layer] = k, v
        return k, v


def init_tensor(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """One tensor of `init_weights`: N(0, 0.02) matrix or embedding, zero bias, unit norm scale.

    Each tensor has its own generator, seeded from `seed` and its name, so a
    device can build only its shard, one tensor at a time, and still hold
    exactly the values the whole model would have.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # a LayerNorm scale
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * _INIT_STD


def init_weights(config: TransformerConfig, seed: int) -> dict[str, Tensor]:
    """Random weights as BERT, GPT-2 and Llama initialise them, deterministic in `seed`.

    Private generators (`init_tensor`) leave the global RNG alone.
    """
    return {name: init_tensor(name, shape, seed) for name, shape in expected_shapes(config).items()}


def forward(
    ids: Tensor,
    w: Mapping[str, Tensor],
    config: TransformerConfig,
    cache: KVCache | None = None,
) -> Tensor:
    """Run the whole model on one device and return what `blocks.head` gives.

    With a cache, `ids` are the new tokens only: they sit after the cached
    positions, attend to them, and their keys and values are appended.

    Raises:
        ConfigError: If the sequence (cached plus new) is longer than
            `max_positions`, or the cache holds a subset of heads or another model.

    """
    offset = 0
    if cache is not None:
        if cache.config != config or cache.heads != range(config.heads):
            raise ConfigError(
                f"the reference forward needs a cache of all {config.heads} heads of this "
                f"model, got heads {cache.heads}"
            )
        offset = cache.length
    if ids.dim() != 1:
        raise ConfigError(f"ids must be 1-D (t,), got shape {tuple(ids.shape)}")
    if offset + ids.shape[0] > config.max_positions:
        raise ConfigError(
            f"sequence of {offset + ids.shape[0]} tokens exceeds max_positions "
            f"{config.max_positions}"
        )
    every_head, every_col = range(config.heads), range(config.ffn)
    x = blocks.embed(ids, w, config, offset)
    for i in range(config.layers):
        q, k, v = blocks.qkv(blocks.attention_input(x, w, i, config), w, i, every_head, config)
        q, k = blocks.rotate(q, k, offset, config)
        if cache is not None:
            k, v = cache.extend(i, k, v)
        context = blocks.attend(q, k, v, config.causal, offset)
        h, mlp_in = blocks.after_attention(
            x, blocks.out_partial(context, w, i, every_head), w, i, config
        )
        up = blocks.mlp_up(mlp_in, w, i, every_col, config)
        x = blocks.after_mlp(h, blocks.mlp_down_partial(up, w, i, every_col), w, i, config)
    return blocks.head(x, w, config)


def generate(
    ids: Tensor,
    w: Mapping[str, Tensor],
    config: TransformerConfig,
    new_tokens: int,
    use_cache: bool = True,
) -> list[int]:
    """Greedy decoding of `new_tokens` tokens after the prompt `ids`; returns only those.

    Without the cache every step reruns the whole sequence, which is the check that
    the cached path computes the same thing.

    Raises:
        ConfigError: For an encoder, a negative count, or a prompt plus new tokens
            that needs more than `max_positions` positions.

    """
    if config.kind != "decoder":
        raise ConfigError(f"generation needs a decoder, got a {config.kind}")
    if new_tokens < 0 or ids.dim() != 1 or ids.shape[0] < 1:
        raise ConfigError(
            f"generate needs a non-empty 1-D prompt and new_tokens >= 0, got prompt shape "
            f"{tuple(ids.shape)} and new_tokens {new_tokens}"
        )
    # the last token generated is never fed back, so it needs no position
    needed = ids.shape[0] + max(new_tokens - 1, 0)
    if needed > config.max_positions:
        raise ConfigError(
            f"prompt of {ids.shape[0]} tokens plus {new_tokens} new needs {needed} positions, "
            f"more than max_positions {config.max_positions}"
        )
    out: list[int] = []
    cache = KVCache(config) if use_cache else None
    seq, feed = ids, ids
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = forward(feed if cache is not None else seq, w, config, cache)
            token = int(logits[-1].argmax())
            out.append(token)
            nxt = torch.tensor([token], dtype=ids.dtype, device=ids.device)
            seq, feed = torch.cat([seq, nxt]), nxt
    return out


def weight_bytes(
    config: TransformerConfig, bytes_per_param: int = _FLOAT32_BYTES
) -> dict[str, int]:
    """Bytes of one layer's MHA weights, one layer's MLP weights, and everything else.

    These are the planner's M_att and M_mlp (Galaxy §III-C), the weights tensor
    parallelism splits; "other" (embeddings, norms, heads) every device keeps whole.
    Counted from the config's options, so it equals the sum over `expected_shapes`.

    Returns:
        `{"attention": ..., "mlp": ..., "other": ...}`.

    """
    return {name: n * bytes_per_param for name, n in config.param_counts().items()}
