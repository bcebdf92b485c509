"""What a Transformer served by Galaxy-style inference is, and how its weights are named.

One description for both shapes the paper serves: a BERT-style encoder
(post-LayerNorm, erf GELU, bidirectional attention) and a GPT-2-style decoder
(pre-LayerNorm, tanh GELU, causal attention, tied LM head). The weights are a
flat `dict[str, Tensor]` under the names below, in `nn.Linear` orientation
(`weight` is `(out, in)`, `y = x @ weight.T + bias`), so a shard is a slice of
rows or columns and nothing else: the planner's heads, MLP columns and
sequence rows map to index ranges of these tensors.

Per layer `i` (prefix `layers.{i}.`):

- `q.weight`, `k.weight`, `v.weight` `(hidden, hidden)` and their `.bias`
  `(hidden,)`: head `h` owns rows `[h * head_dim, (h + 1) * head_dim)`.
- `o.weight` `(hidden, hidden)`: head `h` owns those columns; `o.bias` is added
  once, after the partial outputs are summed.
- `up.weight` `(ffn, hidden)`, `up.bias` `(ffn,)`: MLP column `j` is row `j`.
- `down.weight` `(hidden, ffn)`: column `j` pairs with `up`'s row `j`;
  `down.bias` is added once, after the sum.
- `ln1.weight/bias`, `ln2.weight/bias` `(hidden,)`: for the encoder, `ln1`
  follows attention and `ln2` the MLP (post-LN); for the decoder they precede
  them (pre-LN).

Model-wide: `embed.token` `(vocab, hidden)`, `embed.position`
`(max_positions, hidden)`; the encoder has `embed.norm.weight/bias` and, when it
classifies, `pool.weight/bias` `(hidden, hidden)` and `classify.weight/bias`
`(num_classes, hidden)`; the decoder has `final_norm.weight/bias` and its LM
head is `embed.token` (tied, as GPT-2's is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.errors import ConfigError

__all__ = ["LAYER_KEYS", "TransformerConfig", "layer_key"]

LAYER_KEYS: tuple[str, ...] = (
    "q.weight",
    "q.bias",
    "k.weight",
    "k.bias",
    "v.weight",
    "v.bias",
    "o.weight",
    "o.bias",
    "up.weight",
    "up.bias",
    "down.weight",
    "down.bias",
    "ln1.weight",
    "ln1.bias",
    "ln2.weight",
    "ln2.bias",
)
"""Every tensor of one Transformer layer, by its name inside the layer."""


def layer_key(layer: int, name: str) -> str:
    """The model-wide name of layer `layer`'s tensor `name` (one of `LAYER_KEYS`)."""
    return f"layers.{layer}.{name}"


@dataclass(frozen=True)
class TransformerConfig:
    """The shape of a served Transformer.

    Attributes:
        kind: "encoder" (BERT-style) or "decoder" (GPT-2-style).
        layers: Transformer layers.
        hidden: Model width.
        heads: Attention heads; `hidden` must be a multiple.
        ffn: Width of the MLP's inner layer.
        vocab_size: Token embedding rows.
        max_positions: Position embedding rows: the longest sequence served.
        ln_eps: LayerNorm epsilon (BERT 1e-12, GPT-2 1e-5).
        num_classes: Classifier outputs of an encoder (0: it returns hidden states).

    """

    kind: Literal["encoder", "decoder"]
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab_size: int
    max_positions: int
    ln_eps: float
    num_classes: int = 0

    def __post_init__(self) -> None:
        """Refuse shapes no plan could split: the error names the field and the value."""
        for name in ("layers", "hidden", "heads", "ffn", "vocab_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"transformer {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"transformer hidden ({self.hidden}) must be a multiple of heads ({self.heads})"
            )
        if self.num_classes < 0 or (self.kind == "decoder" and self.num_classes):
            raise ConfigError(
                f"num_classes {self.num_classes} is only for encoders, and must be >= 0"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def causal(self) -> bool:
        """Whether a position attends only to itself and earlier ones (the decoder)."""
        return self.kind == "decoder"

    @property
    def pre_norm(self) -> bool:
        """LayerNorm before each block (GPT-2) rather than after the residual (BERT)."""
        return self.kind == "decoder"
