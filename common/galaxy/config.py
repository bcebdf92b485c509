"""What a Transformer served by Galaxy-style inference is, and how its weights are named.

One description for the shapes served: a BERT-style encoder (post-norm, erf
GELU, bidirectional attention), a GPT-2-style decoder (pre-norm, tanh GELU,
causal attention, tied LM head) and the Llama family (pre-RMSNorm, rotary
positions, SwiGLU MLP, grouped-query attention, no biases, an untied LM head),
which is the GPT-2 decoder with the options below switched. The weights are a
flat `dict[str, Tensor]` under the names below, in `nn.Linear` orientation
(`weight` is `(out, in)`, `y = x @ weight.T + bias`), so a shard is a slice of
rows or columns and nothing else: the planner's heads, MLP columns and
sequence rows map to index ranges of these tensors.

Per layer `i` (prefix `layers.{i}.`), with `d = head_dim` and `kv = kv_heads`:

- `q.weight` `(hidden, hidden)`, `k.weight`, `v.weight` `(kv * d, hidden)` and,
  when `qkv_bias`, their `.bias`: query head `h` owns rows `[h*d, (h+1)*d)` of
  `q`, and uses the keys and values of its KV group `h // (heads // kv)`, which
  owns those rows of `k` and `v`. Heads are split in whole KV groups, so a
  device keeps the keys and values of its own groups only.
- `o.weight` `(hidden, hidden)`: head `h` owns those columns; `o.bias` (when
  `o_bias`) is added once, after the partial outputs are summed.
- `up.weight` `(ffn, hidden)`, `up.bias` `(ffn,)`: MLP column `j` is row `j`;
  a SwiGLU MLP (`down(silu(gate x) * up x)`) also has `gate.weight` (and
  `gate.bias`) of the same shape, split the same way.
- `down.weight` `(hidden, ffn)`: column `j` pairs with `up`'s row `j`;
  `down.bias` (when `mlp_bias`) is added once, after the sum.
- `ln1.weight/bias`, `ln2.weight/bias` `(hidden,)`: for the encoder, `ln1`
  follows attention and `ln2` the MLP (post-norm); for the decoder they precede
  them (pre-norm). An RMSNorm has the `weight` only.

Model-wide: `embed.token` `(vocab, hidden)`, `embed.position`
`(max_positions, hidden)` (absolute positions only: rotary ones have no table);
the encoder has `embed.norm.weight/bias` and, when it classifies,
`pool.weight/bias` `(hidden, hidden)` and `classify.weight/bias`
`(num_classes, hidden)`; the decoder has `final_norm.weight/bias` and its LM
head is `embed.token` when `tied_head` (as GPT-2's is), else `lm_head.weight`
`(vocab, hidden)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.errors import ConfigError

__all__ = ["LAYER_KEYS", "MAX_ROPE_THETA", "TransformerConfig", "layer_key"]

MAX_ROPE_THETA = 1e10
"""Largest rotary base accepted (Llama 3 uses 5e5, some long-context models 1e6-1e8)."""

LAYER_KEYS: tuple[str, ...] = (
    "q.weight",
    "q.bias",
    "k.weight",
    "k.bias",
    "v.weight",
    "v.bias",
    "o.weight",
    "o.bias",
    "gate.weight",
    "gate.bias",
    "up.weight",
    "up.bias",
    "down.weight",
    "down.bias",
    "ln1.weight",
    "ln1.bias",
    "ln2.weight",
    "ln2.bias",
)
"""Every tensor a Transformer layer may have, by its name inside the layer (the
config decides which it has: `weights.expected_shapes`)."""


def layer_key(layer: int, name: str) -> str:
    """The model-wide name of layer `layer`'s tensor `name` (one of `LAYER_KEYS`)."""
    return f"layers.{layer}.{name}"


@dataclass(frozen=True)
class TransformerConfig:
    """The shape of a served Transformer.

    The options after `num_classes` default to BERT / GPT-2, so a config that
    names none of them is one of those two; a Llama-family decoder sets them.

    Attributes:
        kind: "encoder" (BERT-style) or "decoder" (GPT-2 / Llama style).
        layers: Transformer layers.
        hidden: Model width.
        heads: Attention (query) heads; `hidden` must be a multiple.
        ffn: Width of the MLP's inner layer.
        vocab_size: Token embedding rows.
        max_positions: The longest sequence served (rows of the position table,
            when positions are absolute).
        ln_eps: Norm epsilon (BERT 1e-12, GPT-2 1e-5, Llama 1e-5 or 1e-6).
        num_classes: Classifier outputs of an encoder (0: it returns hidden states).
        kv_heads: Key/value heads (grouped-query attention when fewer than
            `heads`, which must be a multiple); None: one per query head.
        norm: "layer" (LayerNorm with bias) or "rms" (RMSNorm, scale only).
        positions: "absolute" (a learned table added to the embeddings) or "rope"
            (rotary, applied to queries and keys; needs an even `head_dim`).
        rope_theta: The rotary base.
        mlp: "gelu" (erf), "gelu_tanh" or "swiglu"; None: gelu for the encoder,
            gelu_tanh for the decoder.
        qkv_bias: Whether q, k, v have biases.
        o_bias: Whether the attention output projection has a bias.
        mlp_bias: Whether the MLP's projections have biases.
        tied_head: Whether a decoder's LM head is `embed.token` (else `lm_head.weight`).

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
    kv_heads: int | None = None
    norm: Literal["layer", "rms"] = "layer"
    positions: Literal["absolute", "rope"] = "absolute"
    rope_theta: float = 10000.0
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] | None = None
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    tied_head: bool = True

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
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ConfigError(
                f"transformer heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}), which must be >= 1"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"rotary positions need an even head_dim, got {self.head_dim} "
                f"(hidden {self.hidden} / heads {self.heads})"
            )
        if not 0.0 < self.rope_theta <= MAX_ROPE_THETA:
            raise ConfigError(
                f"rope_theta must be in (0, {MAX_ROPE_THETA:g}], got {self.rope_theta}"
            )
        if not self.tied_head and self.kind != "decoder":
            raise ConfigError("tied_head=False is for decoders (an encoder has no LM head)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_groups(self) -> int:
        """Key/value heads: `kv_heads`, or one per query head."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def group_size(self) -> int:
        """Query heads sharing one key/value head; a head split must keep groups whole."""
        return self.heads // self.kv_groups

    @property
    def kv_hidden(self) -> int:
        """Rows of `k.weight` and `v.weight`: `kv_groups * head_dim`."""
        return self.kv_groups * self.head_dim

    def kv_range(self, heads: range) -> range:
        """The key/value heads query heads `heads` use (the same range without GQA).

        Raises:
            ConfigError: If `heads` cuts a KV group: a device's query heads must be
                whole groups, so that it holds its own groups' keys and values.

        """
        g = self.group_size
        if heads.step != 1 or heads.start % g or len(heads) % g:
            raise ConfigError(
                f"heads {heads.start}..{heads.stop - 1} cut a key/value group of {g} query "
                f"heads ({self.heads} heads, {self.kv_groups} key/value heads)"
            )
        return range(heads.start // g, heads.start // g + len(heads) // g)

    def param_counts(self) -> dict[str, int]:
        """Parameters of one layer's MHA block, one layer's MLP block, and the rest.

        The planner's M_att and M_mlp (Galaxy §III-C), which tensor parallelism
        splits, and "other" (embeddings, norms, heads) that every device keeps
        whole; counted from the options, so it equals the tensors the weights hold.

        Returns:
            `{"attention": ..., "mlp": ..., "other": ...}`.

        """
        h, f, kv = self.hidden, self.ffn, self.kv_hidden
        attention = 2 * h * h + 2 * kv * h
        attention += (h + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mats = 3 if self.activation == "swiglu" else 2
        mlp = mats * h * f + (((mats - 1) * f + h) if self.mlp_bias else 0)
        norm = 2 * h if self.norm == "layer" else h
        other = self.vocab_size * h + (2 * self.layers + 1) * norm
        if self.positions == "absolute":
            other += self.max_positions * h
        if not self.tied_head:
            other += self.vocab_size * h
        if self.num_classes:
            other += h * h + h + self.num_classes * (h + 1)
        return {"attention": attention, "mlp": mlp, "other": other}

    @property
    def activation(self) -> Literal["gelu", "gelu_tanh", "swiglu"]:
        """The MLP's activation, with the default by kind resolved."""
        if self.mlp is not None:
            return self.mlp
        return "gelu" if self.kind == "encoder" else "gelu_tanh"

    @property
    def causal(self) -> bool:
        """Whether a position attends only to itself and earlier ones (the decoder)."""
        return self.kind == "decoder"

    @property
    def pre_norm(self) -> bool:
        """Norm before each block (GPT-2, Llama) rather than after the residual (BERT)."""
        return self.kind == "decoder"
