from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy import blocks
from services.lib.galaxy.model import init_weights

DECODER = TransformerConfig(
    kind="decoder",
    layers=2,
    hidden=32,
    heads=4,
    ffn=64,
    vocab_size=50,
    max_positions=16,
    ln_eps=1e-5,
)
ENCODER = TransformerConfig(
    kind="encoder",
    layers=2,
    hidden=32,
    heads=4,
    ffn=64,
    vocab_size=50,
    max_positions=16,
    ln_eps=1e-12,
    num_classes=3,
)


def _weights(config: TransformerConfig) -> dict[str, Tensor]:
    """Init weights with every bias and LayerNorm perturbed, so none of them is a no-op."""
    w = init_weights(config, seed=1)
    gen = torch.Generator().manual_seed(2)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in w.items()}


def _plain_attention(
    x: Tensor, w: dict[str, Tensor], layer: int, config: TransformerConfig
) -> Tensor:
    """MHA written per head with explicit loops: the reference for the split pieces."""
    t, d = x.shape[0], config.head_dim
    p = f"layers.{layer}."
    q = x @ w[p + "q.weight"].T + w[p + "q.bias"]
    k = x @ w[p + "k.weight"].T + w[p + "k.bias"]
    v = x @ w[p + "v.weight"].T + w[p + "v.bias"]
    out = torch.zeros(t, config.hidden)
    for h in range(config.heads):
        cols = slice(h * d, (h + 1) * d)
        for i in range(t):
            visible = i + 1 if config.causal else t
            s = torch.stack([q[i, cols] @ k[j, cols] for j in range(visible)]) / math.sqrt(d)
            p_ = torch.softmax(s, dim=0)
            ctx = sum(p_[j] * v[j, cols] for j in range(visible))
            assert isinstance(ctx, Tensor)
            out[i] += ctx @ w[p + "o.weight"][:, cols].T
    return out


@pytest.mark.parametrize("config", [DECODER, ENCODER], ids=["decoder", "encoder"])
def test_full_range_attention_matches_plain_per_head_loop(config: TransformerConfig) -> None:
    w = _weights(config)
    x = torch.randn(5, config.hidden)
    every = range(config.heads)
    q, k, v = blocks.qkv(x, w, 0, every, config)
    assert q.shape == k.shape == v.shape == (config.heads, 5, config.head_dim)
    got = blocks.out_partial(blocks.attend(q, k, v, config.causal, 0), w, 0, every)
    torch.testing.assert_close(got, _plain_attention(x, w, 0, config), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [DECODER, ENCODER], ids=["decoder", "encoder"])
@pytest.mark.parametrize("split", [(1, 3), (2, 2), (0, 4), (3, 1)])
def test_attention_split_over_heads_sums_to_full(
    config: TransformerConfig, split: tuple[int, int]
) -> None:
    w = _weights(config)
    x = torch.randn(7, config.hidden)
    every = range(config.heads)
    full = blocks.out_partial(
        blocks.attend(*blocks.qkv(x, w, 1, every, config), config.causal, 0), w, 1, every
    )
    total = torch.zeros_like(full)
    first = split[0]
    for heads in (range(0, first), range(first, config.heads)):
        q, k, v = blocks.qkv(x, w, 1, heads, config)
        total += blocks.out_partial(blocks.attend(q, k, v, config.causal, 0), w, 1, heads)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=0)
    # a share holds exactly those heads' rows of the full projections
    q_full = blocks.qkv(x, w, 1, every, config)[0]
    q_part = blocks.qkv(x, w, 1, range(1, 3), config)[0]
    torch.testing.assert_close(q_part, q_full[1:3], atol=1e-6, rtol=0)


@pytest.mark.parametrize("config", [DECODER, ENCODER], ids=["decoder", "encoder"])
def test_mlp_split_over_columns_sums_to_full(config: TransformerConfig) -> None:
    w = _weights(config)
    x = torch.randn(6, config.hidden)
    every = range(config.ffn)
    full = blocks.mlp_down_partial(blocks.mlp_up(x, w, 0, every, config), w, 0, every)
    total = torch.zeros_like(full)
    for cols in (range(0, 11), range(11, 40), range(40, 40), range(40, config.ffn)):
        total += blocks.mlp_down_partial(blocks.mlp_up(x, w, 0, cols, config), w, 0, cols)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=0)
    # and the full MLP is the plain two-layer perceptron with the model's GELU
    p = "layers.0."
    act = "tanh" if config.kind == "decoder" else "none"
    hidden = torch.nn.functional.gelu(x @ w[p + "up.weight"].T + w[p + "up.bias"], approximate=act)
    torch.testing.assert_close(full, hidden @ w[p + "down.weight"].T, atol=1e-5, rtol=1e-5)


def test_tanh_and_erf_gelu_differ_so_the_choice_is_tested() -> None:
    w = _weights(DECODER)
    x = 3 * torch.randn(4, 32)
    tanh = blocks.mlp_up(x, w, 0, range(64), DECODER)
    erf = blocks.mlp_up(x, w, 0, range(64), ENCODER)
    assert (tanh - erf).abs().max() > 1e-5


def test_causal_attend_with_offset_equals_rows_of_full_attend() -> None:
    q, k, v = (torch.randn(3, 9, 8) for _ in range(3))
    full = blocks.attend(q, k, v, causal=True, q_offset=0)
    part = blocks.attend(q[:, 4:7], k, v, causal=True, q_offset=4)
    torch.testing.assert_close(part, full[4:7], atol=1e-6, rtol=0)
    # the first query sees only the first key: its context is that key's value
    torch.testing.assert_close(full[0].view(3, 8), v[:, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("config", [DECODER, ENCODER], ids=["decoder", "encoder"])
def test_row_wise_blocks_act_on_any_subset_of_rows(config: TransformerConfig) -> None:
    w = _weights(config)
    ids = torch.randint(0, config.vocab_size, (8,))
    x = blocks.embed(ids, w, config)
    torch.testing.assert_close(blocks.embed(ids[3:6], w, config, offset=3), x[3:6])
    attn = torch.randn(8, config.hidden)
    h, mlp_in = blocks.after_attention(x, attn, w, 1, config)
    h_part, mlp_in_part = blocks.after_attention(x[2:5], attn[2:5], w, 1, config)
    torch.testing.assert_close(h_part, h[2:5])
    torch.testing.assert_close(mlp_in_part, mlp_in[2:5])
    torch.testing.assert_close(
        blocks.attention_input(x[5:], w, 1, config), blocks.attention_input(x, w, 1, config)[5:]
    )
    mlp = torch.randn(8, config.hidden)
    torch.testing.assert_close(
        blocks.after_mlp(h[:3], mlp[:3], w, 1, config), blocks.after_mlp(h, mlp, w, 1, config)[:3]
    )


def test_connective_blocks_follow_post_ln_and_pre_ln() -> None:
    ln = torch.nn.functional.layer_norm
    x, attn = torch.randn(4, 32), torch.randn(4, 32)
    w = _weights(ENCODER)
    p = "layers.0."
    h, mlp_in = blocks.after_attention(x, attn, w, 0, ENCODER)
    want = ln(x + attn + w[p + "o.bias"], (32,), w[p + "ln1.weight"], w[p + "ln1.bias"], 1e-12)
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(mlp_in, want)
    w = _weights(DECODER)
    h, mlp_in = blocks.after_attention(x, attn, w, 0, DECODER)
    torch.testing.assert_close(h, x + attn + w[p + "o.bias"])
    torch.testing.assert_close(mlp_in, ln(h, (32,), w[p + "ln2.weight"], w[p + "ln2.bias"], 1e-5))
    torch.testing.assert_close(blocks.after_mlp(h, x, w, 0, DECODER), h + x + w[p + "down.bias"])


def test_head_shapes() -> None:
    x = torch.randn(5, 32)
    assert blocks.head(x, _weights(ENCODER), ENCODER).shape == (3,)
    assert blocks.head(x, _weights(DECODER), DECODER).shape == (5, 50)
    bare = TransformerConfig(
        kind="encoder",
        layers=1,
        hidden=32,
        heads=4,
        ffn=64,
        vocab_size=50,
        max_positions=16,
        ln_eps=1e-12,
    )
    assert blocks.head(x, {}, bare) is x


def test_bad_inputs_are_config_errors_naming_the_problem() -> None:
    w = _weights(DECODER)
    x = torch.randn(3, 32)
    with pytest.raises(ConfigError, match=r"within \[0, 4\)"):
        blocks.qkv(x, w, 0, range(2, 6), DECODER)
    with pytest.raises(ConfigError, match="step-1"):
        blocks.mlp_up(x, w, 0, range(0, 64, 2), DECODER)
    with pytest.raises(ConfigError, match="max_positions 16"):
        blocks.embed(torch.zeros(5, dtype=torch.long), w, DECODER, offset=12)
    with pytest.raises(ConfigError, match=r"\[0, 50\)"):
        blocks.embed(torch.tensor([3, 50]), w, DECODER)
    with pytest.raises(ConfigError, match=r"layers\.9\.q\.weight"):
        blocks.qkv(x, w, 9, range(4), DECODER)
