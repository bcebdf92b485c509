"""The pieces of a Transformer layer that hybrid model parallelism splits.

Galaxy (§III-B) cuts each layer into an MHA block and an MLP block, split by
heads and MLP columns across devices, and the connective blocks around them
(residual add, bias, LayerNorm), split by sequence rows. Every function here is
one such piece for a single request: hidden states are `(t, hidden)` rows.
The row-wise ones act on any subset of rows, and `out_partial` /
`mlp_down_partial` summed over a partition of heads / columns give the full
block, so a distributed executor needs nothing else.

The Llama family's pieces are options of the same functions (the config says
which): RMSNorm for LayerNorm, SwiGLU for GELU, grouped-query attention (a
head range maps to its KV groups' rows of `k` and `v`), rotary positions
(`rotate`, applied to queries and keys once their rows' positions are known)
and absent biases.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig, layer_key

__all__ = [
    "after_attention",
    "after_mlp",
    "attend",
    "attention_input",
    "embed",
    "head",
    "mlp_down_partial",
    "mlp_up",
    "out_partial",
    "qkv",
    "rotate",
]


def _get(w: Mapping[str, Tensor], key: str) -> Tensor:
    """Look a tensor up so that a missing one is a ConfigError naming it, not a KeyError."""
    try:
        return w[key]
    except KeyError:
        raise ConfigError(f"weights lack tensor {key!r}") from None


def _lw(w: Mapping[str, Tensor], layer: int, name: str) -> Tensor:
    return _get(w, layer_key(layer, name))


def _bias(w: Mapping[str, Tensor], layer: int, name: str, present: bool) -> Tensor | None:
    """Layer `layer`'s bias `name`, or None when the config says the model has none."""
    return _lw(w, layer, f"{name}.bias") if present else None


def _norm(x: Tensor, w: Mapping[str, Tensor], prefix: str, config: TransformerConfig) -> Tensor:
    """LayerNorm, or RMSNorm computed as transformers' LlamaRMSNorm does (in float32)."""
    weight = _get(w, f"{prefix}.weight")
    if config.norm == "layer":
        return F.layer_norm(x, (x.shape[-1],), weight, _get(w, f"{prefix}.bias"), config.ln_eps)
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + config.ln_eps)
    return weight * y.to(x.dtype)


def _check_heads(heads: range, config: TransformerConfig) -> range:
    """The KV heads of `heads`; refuse a range that is not step-1, leaves the model or cuts a group.

    An empty range is allowed: a device may have no heads.
    """
    if heads.step != 1 or (len(heads) and (heads.start < 0 or heads.stop > config.heads)):
        raise ConfigError(f"heads must be a step-1 range within [0, {config.heads}), got {heads}")
    return config.kv_range(heads)


def _cols(cols: range, ffn: int) -> slice:
    """Columns `cols` as a slice; a device with no share gets an empty one."""
    if cols.step != 1 or (len(cols) and (cols.start < 0 or cols.stop > ffn)):
        raise ConfigError(f"MLP columns must be a step-1 range within [0, {ffn}), got {cols}")
    return slice(cols.start, cols.start + len(cols))


def embed(
    ids: Tensor, w: Mapping[str, Tensor], config: TransformerConfig, offset: int = 0
) -> Tensor:
    """Token plus position embeddings of `ids` at positions `offset..offset+t-1`.

    The encoder normalises the sum (BERT); the decoder does not (GPT-2). Rotary
    positions add nothing here: `rotate` turns queries and keys instead.

    Raises:
        ConfigError: If `ids` is not 1-D, a position passes `max_positions`, or an id
            is outside the vocabulary.

    """
    if ids.dim() != 1:
        raise ConfigError(f"ids must be 1-D (t,), got shape {tuple(ids.shape)}")
    t = ids.shape[0]
    if offset < 0 or offset + t > config.max_positions:
        raise ConfigError(
            f"positions {offset}..{offset + t - 1} exceed max_positions "
            f"{config.max_positions} (sequence of {offset + t} tokens)"
        )
    if t and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise ConfigError(
            f"token ids must be in [0, {config.vocab_size}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    x = _get(w, "embed.token")[ids]
    if config.positions == "absolute":
        x = x + _get(w, "embed.position")[offset : offset + t]
    if config.kind == "encoder":
        x = _norm(x, w, "embed.norm", config)
    return x


def attention_input(
    x: Tensor, w: Mapping[str, Tensor], layer: int, config: TransformerConfig
) -> Tensor:
    """What the MHA block consumes from residual rows `x`: LN1(x) pre-LN, `x` post-LN."""
    if config.pre_norm:
        return _norm(x, w, layer_key(layer, "ln1"), config)
    return x


def qkv(
    x: Tensor, w: Mapping[str, Tensor], layer: int, heads: range, config: TransformerConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries `(len(heads), t, d)` and keys, values `(len(kv), t, d)` of heads `heads`.

    Head `h` owns rows `[h*d, (h+1)*d)` of `q`; its KV group `kv` (`config.kv_range`)
    owns those rows of `k` and `v`, so a device computes only its share. `config`
    supplies the head width and the groups, which the weights alone do not. Rotary
    positions are not applied yet (`rotate`): a GEMM over row tiles does not know
    where its rows sit.
    """
    kv = _check_heads(heads, config)
    d = config.head_dim
    out: list[Tensor] = []
    for name, share in (("q", heads), ("k", kv), ("v", kv)):
        rows = slice(share.start * d, (share.start + len(share)) * d)
        weight, bias = _lw(w, layer, f"{name}.weight"), _bias(w, layer, name, config.qkv_bias)
        y = F.linear(x, weight[rows], None if bias is None else bias[rows])
        out.append(y.view(x.shape[0], len(share), d).transpose(0, 1))
    return out[0], out[1], out[2]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@functools.lru_cache(maxsize=16)
def _inv_freq(theta: float, d: int, device: torch.device) -> Tensor:
    """RoPE's inverse frequencies, computed on the CPU as transformers does, kept per device.

    A decode step rotates every layer's new row: the table is made once, not per call.
    """
    return (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(device)


def rotate(q: Tensor, k: Tensor, offset: int, config: TransformerConfig) -> tuple[Tensor, Tensor]:
    """Rotary positions on queries and keys `(h, t, d)` whose row 0 sits at `offset`.

    transformers' Llama convention (rotate_half: the two halves of a head are the
    pair), with its float32 frequencies, so logits agree with its own forward.
    Absolute positions leave both unchanged (the embedding holds them).
    """
    if config.positions != "rope":
        return q, k
    if offset < 0:
        raise ConfigError(f"rotary offset must be >= 0, got {offset}")
    inv_freq = _inv_freq(config.rope_theta, config.head_dim, q.device)
    pos = torch.arange(offset, offset + q.shape[1], dtype=torch.float32, device=q.device)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, q_offset: int) -> Tensor:
    """Scaled dot-product attention; query row i sits at position `q_offset + i`, key j at j.

    Plain matmul and softmax so every device computes the same function as the
    reference. Under grouped-query attention `k`, `v` have fewer heads than `q`
    (a divisor): query head `i` uses KV head `i // (hq // hkv)`, as transformers'
    repeat_kv has it. A group's queries are stacked as rows against their one KV
    head, so the (cached) keys and values are never copied per query head.
    Returns the context `(tq, hq * d)` with heads in order.
    """
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[2] != k.shape[2]
        or (k.shape[0] == 0 and q.shape[0] != 0)
        or (k.shape[0] and q.shape[0] % k.shape[0])
    ):
        raise ConfigError(
            f"attend needs q (hq, tq, d) and k, v (hkv, tk, d) alike with hkv dividing hq, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q_offset < 0:
        raise ConfigError(f"q_offset must be >= 0, got {q_offset}")
    h, tq, d = q.shape
    hkv = k.shape[0]
    group = h // hkv if hkv else 1
    # (h, tq, d) -> (hkv, group * tq, d): query head kv*group + j is row block j of kv
    scores = torch.matmul(q.reshape(hkv, group * tq, d), k.transpose(1, 2)) / math.sqrt(d)
    if causal:
        q_pos = torch.arange(q_offset, q_offset + tq, device=q.device).repeat(group).unsqueeze(1)
        k_pos = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    context = torch.matmul(scores.softmax(dim=-1), v).view(h, tq, d)
    return context.transpose(0, 1).reshape(tq, h * d)


def out_partial(context: Tensor, w: Mapping[str, Tensor], layer: int, heads: range) -> Tensor:
    """One device's share of the output projection, `(t, hidden)`, without the bias.

    Summing it over a partition of the heads gives the full projection; the bias is
    added once, in `after_attention`.
    """
    weight = _lw(w, layer, "o.weight")
    if len(heads) == 0:
        return context.new_zeros(context.shape[0], weight.shape[0])
    if heads.step != 1 or heads.start < 0 or context.shape[-1] % len(heads):
        raise ConfigError(
            f"context width {context.shape[-1]} must be a multiple of {len(heads)} heads "
            f"given as a step-1 range, got {heads}"
        )
    d = context.shape[-1] // len(heads)
    if heads.stop * d > weight.shape[1]:
        raise ConfigError(f"heads {heads} of width {d} pass o.weight's {weight.shape[1]} columns")
    return context @ weight[:, heads.start * d : heads.stop * d].T


def after_attention(
    x: Tensor, attn: Tensor, w: Mapping[str, Tensor], layer: int, config: TransformerConfig
) -> tuple[Tensor, Tensor]:
    """The connective block after MHA, row-wise: returns `(h, mlp_in)`.

    `attn` is the sum of every device's `out_partial` rows. Post-LN (encoder):
    `h = LN1(x + attn + o.bias)` and the MLP eats `h`; pre-LN (decoder):
    `h = x + attn + o.bias` and the MLP eats `LN2(h)`. No `o.bias` when `o_bias` is off.
    """
    h = x + attn
    if config.o_bias:
        h = h + _lw(w, layer, "o.bias")
    if config.pre_norm:
        return h, _norm(h, w, layer_key(layer, "ln2"), config)
    h = _norm(h, w, layer_key(layer, "ln1"), config)
    return h, h


def mlp_up(
    x: Tensor, w: Mapping[str, Tensor], layer: int, cols: range, config: TransformerConfig
) -> Tensor:
    """The activated MLP columns `cols`, `(t, len(cols))`: what `down` consumes.

    erf GELU (BERT) or its tanh approximation (GPT-2) of `up x`, or SwiGLU's
    `silu(gate x) * up x` (Llama), whose `gate` is split by the same columns.
    """
    sl = _cols(cols, config.ffn)

    def project(name: str) -> Tensor:
        weight, bias = _lw(w, layer, f"{name}.weight"), _bias(w, layer, name, config.mlp_bias)
        return F.linear(x, weight[sl], None if bias is None else bias[sl])

    if config.activation == "swiglu":
        return F.silu(project("gate")) * project("up")
    return F.gelu(project("up"), approximate="tanh" if config.activation == "gelu_tanh" else "none")


def mlp_down_partial(e: Tensor, w: Mapping[str, Tensor], layer: int, cols: range) -> Tensor:
    """One device's share of the down projection, `(t, hidden)`, without the bias."""
    weight = _lw(w, layer, "down.weight")
    sl = _cols(cols, weight.shape[1])
    return e @ weight[:, sl].T


def after_mlp(
    h: Tensor, mlp: Tensor, w: Mapping[str, Tensor], layer: int, config: TransformerConfig
) -> Tensor:
    """The connective block after the MLP: `LN2(h + mlp + down.bias)` post-LN, else no LN."""
    y = h + mlp
    if config.mlp_bias:
        y = y + _lw(w, layer, "down.bias")
    if config.pre_norm:
        return y
    return _norm(y, w, layer_key(layer, "ln2"), config)


def head(x: Tensor, w: Mapping[str, Tensor], config: TransformerConfig) -> Tensor:
    """The model's output from the last hidden rows.

    Encoder: class logits `(num_classes,)` from the first row through BERT's pooler,
    or the hidden states themselves when it does not classify. Decoder: LM logits
    `(t, vocab)` through the tied token embedding, or `lm_head.weight` when untied.
    """
    if config.kind == "encoder":
        if config.num_classes == 0:
            return x
        pooled = torch.tanh(F.linear(x[0], _get(w, "pool.weight"), _get(w, "pool.bias")))
        return F.linear(pooled, _get(w, "classify.weight"), _get(w, "classify.bias"))
    lm_head = _get(w, "embed.token" if config.tied_head else "lm_head.weight")
    return _norm(x, w, "final_norm", config) @ lm_head.T
