from __future__ import annotations

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy.model import KVCache, forward, generate, init_weights, weight_bytes

DECODER = TransformerConfig(
    kind="decoder",
    layers=2,
    hidden=32,
    heads=4,
    ffn=64,
    vocab_size=40,
    max_positions=20,
    ln_eps=1e-5,
)
ENCODER = TransformerConfig(
    kind="encoder",
    layers=2,
    hidden=32,
    heads=4,
    ffn=64,
    vocab_size=40,
    max_positions=20,
    ln_eps=1e-12,
    num_classes=3,
)


def _weights(config: TransformerConfig) -> dict[str, Tensor]:
    w = init_weights(config, seed=3)
    gen = torch.Generator().manual_seed(4)
    # larger weights than N(0, 0.02) so that greedy decoding does not repeat one token
    return {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in w.items()}


def test_init_weights_is_deterministic_and_bert_gpt2_style() -> None:
    a, b = init_weights(DECODER, seed=5), init_weights(DECODER, seed=5)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.token"], init_weights(DECODER, seed=6)["embed.token"])
    assert torch.equal(a["layers.1.q.bias"], torch.zeros(32))
    assert torch.equal(a["final_norm.weight"], torch.ones(32))
    assert abs(float(a["embed.token"].std()) - 0.02) < 0.002


def test_cached_generation_equals_uncached() -> None:
    w = _weights(DECODER)
    prompt = torch.tensor([5, 17, 2, 33])
    cached = generate(prompt, w, DECODER, new_tokens=10, use_cache=True)
    plain = generate(prompt, w, DECODER, new_tokens=10, use_cache=False)
    assert cached == plain
    assert len(cached) == 10
    assert len(set(cached)) > 1  # a degenerate model would pass trivially
    # the reference decoding, token by token with the full sequence each time
    seq = prompt.tolist()
    for _ in range(10):
        seq.append(int(forward(torch.tensor(seq), w, DECODER)[-1].argmax()))
    assert seq[4:] == cached


def test_cached_logits_equal_full_forward_rows() -> None:
    w = _weights(DECODER)
    ids = torch.randint(0, 40, (12,))
    full = forward(ids, w, DECODER)
    cache = KVCache(DECODER)
    parts = [forward(ids[a:b], w, DECODER, cache) for a, b in ((0, 5), (5, 6), (6, 11), (11, 12))]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=0)


def test_decoder_is_causal_and_encoder_is_not() -> None:
    ids = torch.randint(0, 40, (8,))
    changed = ids.clone()
    changed[6] = (ids[6] + 1) % 40
    w = _weights(DECODER)
    a, b = forward(ids, w, DECODER), forward(changed, w, DECODER)
    torch.testing.assert_close(a[:6], b[:6], atol=1e-6, rtol=0)
    assert (a[6] - b[6]).abs().max() > 1e-4
    e = _weights(ENCODER)
    assert (forward(ids, e, ENCODER) - forward(changed, e, ENCODER)).abs().max() > 1e-6


def test_sequences_past_max_positions_are_refused() -> None:
    w = _weights(DECODER)
    with pytest.raises(ConfigError, match=r"21 tokens.*max_positions 20"):
        forward(torch.zeros(21, dtype=torch.long), w, DECODER)
    cache = KVCache(DECODER)
    forward(torch.zeros(15, dtype=torch.long), w, DECODER, cache)
    with pytest.raises(ConfigError, match=r"21 tokens.*max_positions 20"):
        forward(torch.zeros(6, dtype=torch.long), w, DECODER, cache)
    assert cache.length == 15  # a refused step leaves the cache as it was
    with pytest.raises(ConfigError, match=r"max_positions 20"):
        generate(torch.zeros(10, dtype=torch.long), w, DECODER, new_tokens=12)
    # exactly filling the table is fine: the last token is never fed back
    assert len(generate(torch.zeros(10, dtype=torch.long), w, DECODER, new_tokens=11)) == 11


def test_encoder_refuses_generation_and_cache() -> None:
    w = _weights(ENCODER)
    with pytest.raises(ConfigError, match="decoder"):
        generate(torch.tensor([1, 2]), w, ENCODER, new_tokens=2)
    with pytest.raises(ConfigError, match="decoder"):
        KVCache(ENCODER)
    assert forward(torch.tensor([1, 2, 3, 4, 5]), w, ENCODER).shape == (3,)


def test_cache_of_a_subset_of_heads() -> None:
    cache = KVCache(DECODER, heads=range(1, 3))
    k, v = cache.extend(0, torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    cache.extend(1, k, v)
    k2, _ = cache.extend(0, torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    assert k2.shape == (2, 4, 8)
    torch.testing.assert_close(k2[:, :3], k)
    with pytest.raises(ConfigError, match=r"\(2, t, 8\)"):
        cache.extend(1, torch.randn(4, 1, 8), torch.randn(4, 1, 8))
    with pytest.raises(ConfigError, match="all 4 heads"):
        forward(torch.tensor([1]), _weights(DECODER), DECODER, cache)


def test_weight_bytes_partition_all_parameters() -> None:
    for config in (DECODER, ENCODER):
        w = init_weights(config, seed=0)
        sizes = weight_bytes(config)
        total = sum(t.numel() * t.element_size() for t in w.values())
        layered = config.layers * (sizes["attention"] + sizes["mlp"])
        assert layered + sizes["other"] == total
        att = sum(
            t.numel() * 4
            for k, t in w.items()
            if k.startswith("layers.0.") and k.split(".")[2] in ("q", "k", "v", "o")
        )
        assert sizes["attention"] == att
        assert sizes["mlp"] == 4 * (2 * 32 * 64 + 64 + 32)
