"""Llama-family decoders (RMSNorm, RoPE, SwiGLU, grouped-query attention) against transformers.

The reference is transformers' own forward and greedy `generate` of tiny seeded
models; our single-device model and every distributed mode over in-process rings
must give the same logits (within 1e-4) and the same tokens, with and without
the KV cache, including devices with no heads or no rows.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy import model, sources
from services.lib.galaxy.weights import expected_shapes, from_transformers
from services.worker.galaxy import hmp
from services.worker.galaxy.collectives import row_offsets
from services.worker.galaxy.hmp import RingLayout
from services.worker.galaxy.profiling import profile_blocks
from services.worker.galaxy.ring import LocalRing, local_rings
from tests.galaxy.test_collectives import run_on_ring
from tests.gpu import exact_cuda

transformers = pytest.importorskip("transformers")

T = 7  # prompt tokens
NEW = 5  # generated tokens
ATOL = 1e-4
FFN = 96
MODELS = {"4q2kv": (64, 4, 2), "6q3kv": (48, 6, 3)}
"""(hidden, heads, kv_heads): groups of 2 query heads, 2 or 3 KV heads."""


def _perturb(m: nn.Module) -> None:
    """Sharpen the matrices and move norms and biases off 1 and 0, so a mis-mapped one shows."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


@cache
def _hf(arch: str = "Llama", name: str = "4q2kv", tied: bool = False, **extra: Any) -> Any:
    """A tiny seeded transformers causal LM, eager attention, no EOS so generation never stops."""
    hidden, heads, kv = MODELS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{arch}Config")(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=2,
        intermediate_size=FFN,
        vocab_size=100,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="eager",
        **extra,
    )
    m = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    _perturb(m)
    return m.eval()


@cache
def _ours(name: str = "4q2kv") -> tuple[TransformerConfig, dict[str, Tensor]]:
    return from_transformers(_hf(name=name))


def _prompt(n: int = T) -> Tensor:
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n))


def _hf_logits(m: Any, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return m(ids[None]).logits[0]  # type: ignore[no-any-return]


def _hf_generate(m: Any, ids: Tensor, new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = m.generate(ids[None], max_new_tokens=new, do_sample=False)
    return [int(t) for t in out[0, ids.shape[0] :]]


@pytest.mark.parametrize(
    ("arch", "tied", "extra"),
    [
        ("Llama", False, {}),
        ("Llama", True, {}),
        ("Llama", False, {"attention_bias": True, "mlp_bias": True}),
        ("Mistral", False, {"sliding_window": 32}),
        ("Qwen2", False, {}),
    ],
)
def test_reference_forward_and_generate_equal_transformers(
    arch: str, tied: bool, extra: dict[str, Any]
) -> None:
    hf = _hf(arch, "4q2kv", tied, **extra)
    config, w = from_transformers(hf)
    assert (config.kv_heads, config.norm, config.positions, config.activation) == (
        2,
        "rms",
        "rope",
        "swiglu",
    )
    assert config.tied_head == tied and ("lm_head.weight" in w) == (not tied)
    assert set(w) == set(expected_shapes(config))
    ids = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward(ids, w, config), _hf_logits(hf, ids), rtol=0, atol=ATOL
        )
    expected = _hf_generate(hf, ids)
    assert model.generate(ids, w, config, NEW) == expected
    assert model.generate(ids, w, config, NEW, use_cache=False) == expected


def test_mistral_serves_only_sequences_within_its_window() -> None:
    config, _ = from_transformers(_hf("Mistral", sliding_window=32))
    assert config.max_positions == 32


def test_the_cache_holds_kv_heads_only_and_cached_steps_give_transformers_logits() -> None:
    hf, (config, w) = _hf(), _ours()
    ids = _prompt(T + 2)
    cache_ = model.KVCache(config)
    with torch.no_grad():
        steps = [
            model.forward(p, w, config, cache_) for p in (ids[:T], ids[T : T + 1], ids[T + 1 :])
        ]
    torch.testing.assert_close(torch.cat(steps), _hf_logits(hf, ids), rtol=0, atol=ATOL)
    assert cache_.kv_heads == range(2) and cache_.length == T + 2
    k, _ = cache_.extend(0, torch.zeros(2, 0, config.head_dim), torch.zeros(2, 0, config.head_dim))
    assert k.shape == (2, T + 2, config.head_dim)  # 2 KV heads, not the 4 query heads


# heads per device in whole groups of 2; uneven columns and rows; devices with nothing
LAYOUTS = {
    "4q2kv": {
        "galaxy2-overlap": RingLayout("galaxy", (2, 2), (60, 36), (5, 2), overlap=True),
        "galaxy3-no-heads": RingLayout("galaxy", (2, 0, 2), (40, 30, 26), (3, 0, 4), True),
        "galaxy3-plain": RingLayout("galaxy", (0, 2, 2), (10, 50, 36), (2, 4, 1)),
        "megatron2": RingLayout("megatron", (2, 2), (50, 46), (T, T)),
        "megatron3": RingLayout("megatron", (2, 2, 0), (30, 30, 36), (T, T, T)),
        "sp2": RingLayout("sp", (4, 4), (FFN, FFN), (4, 3)),
        "sp3-empty-device": RingLayout("sp", (4,) * 3, (FFN,) * 3, (0, 3, 4)),
    },
    "6q3kv": {
        "galaxy3-overlap": RingLayout("galaxy", (2, 2, 2), (20, 40, 36), (1, 4, 2), True),
        "galaxy3-uneven": RingLayout("galaxy", (4, 2, 0), (48, 0, 48), (3, 3, 1)),
        "megatron3": RingLayout("megatron", (2, 4, 0), (16, 40, 40), (T, T, T)),
        "sp3": RingLayout("sp", (6,) * 3, (FFN,) * 3, (2, 0, 5)),
    },
}
CASES = [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(("name", "layout_name"), CASES)
def test_every_mode_equals_transformers_with_and_without_cache(name: str, layout_name: str) -> None:
    hf, (config, w) = _hf(name=name), _ours(name)
    layout = LAYOUTS[name][layout_name]
    ids = _prompt(T + 2)
    reference = _hf_logits(hf, ids)

    def body(ring: LocalRing) -> tuple[Tensor, list[Tensor], list[int]]:
        whole = hmp.run(ring, layout, w, config, ids[:T], timeout_s=10)
        cache_ = hmp.new_cache(layout, ring.rank, config)
        steps = [
            hmp.run(ring, layout, w, config, part, cache_, timeout_s=10)
            for part in (ids[:T], ids[T : T + 1], ids[T + 1 :])
        ]
        tokens = hmp.generate(ring, layout, w, config, ids[:T], NEW, timeout_s=10)
        return whole, steps, tokens

    with torch.no_grad():
        got = run_on_ring(len(layout.rows), body)
    expected = _hf_generate(hf, ids[:T])
    for whole, steps, tokens in got:
        torch.testing.assert_close(whole, reference[:T], rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.cat(steps), reference, rtol=0, atol=ATOL)
        assert tokens == expected


@pytest.mark.parametrize("layout_name", ["galaxy3-uneven", "megatron3"])
def test_sharded_devices_keep_only_their_kv_groups_and_generate_alike(layout_name: str) -> None:
    hf, (config, w) = _hf(name="6q3kv"), _ours("6q3kv")
    layout = LAYOUTS["6q3kv"][layout_name]
    heads, cols = row_offsets(list(layout.heads)), row_offsets(list(layout.cols))
    shards = [
        sources.shard(w, config, range(heads[d], heads[d + 1]), range(cols[d], cols[d + 1]))
        for d in range(3)
    ]
    assert [s["layers.0.k.weight"].shape[0] // config.head_dim for s in shards] == [
        h // config.group_size for h in layout.heads
    ]
    ids = _prompt()
    got = run_on_ring(
        3,
        lambda r: hmp.generate(
            r, layout, shards[r.rank], config, ids, NEW, timeout_s=10, sharded=True
        ),
    )
    assert got == [_hf_generate(hf, ids)] * 3


def test_local_mode_generates_what_transformers_does() -> None:
    hf, (config, w) = _hf(), _ours()
    layout = RingLayout("local", (4,), (FFN,), (T,))
    ids = _prompt()
    assert hmp.generate(None, layout, w, config, ids, NEW) == _hf_generate(hf, ids)


def test_a_device_caches_only_its_own_kv_groups() -> None:
    config, _ = _ours("6q3kv")
    layout = LAYOUTS["6q3kv"]["galaxy3-uneven"]
    caches = [hmp.new_cache(layout, rank, config) for rank in range(3)]
    assert [c.kv_heads for c in caches] == [range(0, 2), range(2, 3), range(3, 3)]


def test_a_share_that_cuts_a_kv_group_is_refused_naming_it() -> None:
    config, w = _ours()
    layout = RingLayout("megatron", (1, 3), (48, 48), (T, T))
    with pytest.raises(ConfigError, match=r"cut a key/value group of 2 query heads"):
        hmp.run(local_rings(2)[0], layout, w, config, _prompt())
    with pytest.raises(ConfigError, match="key/value group"):
        model.KVCache(config, range(1, 3))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_heads": 3}, "multiple of kv_heads"),
        ({"kv_heads": 0}, "multiple of kv_heads"),
        ({"hidden": 12, "heads": 4, "positions": "rope"}, "even head_dim"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"kind": "encoder", "tied_head": False}, "tied_head"),
    ],
)
def test_configs_we_cannot_compute_are_refused(change: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "kind": "decoder",
        "layers": 1,
        "hidden": 64,
        "heads": 4,
        "ffn": 8,
        "vocab_size": 10,
        "max_positions": 8,
        "ln_eps": 1e-5,
    }
    with pytest.raises(ConfigError, match=message):
        TransformerConfig(**{**base, **change})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hidden_act": "gelu"}, "must be 'silu'"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rotary scaling 'linear'",
        ),
    ],
)
def test_llamas_we_do_not_compute_are_refused(extra: dict[str, Any], message: str) -> None:
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=10,
        **extra,
    )
    with pytest.raises(ConfigError, match=message):
        from_transformers(transformers.LlamaForCausalLM(cfg))


def test_weight_bytes_count_every_tensor_of_a_llama() -> None:
    config, w = _ours()
    sizes = model.weight_bytes(config)
    block = {k.split(".")[2]: 0 for k in w if k.startswith("layers.")}
    for k, t in w.items():
        if k.startswith("layers."):
            block[k.split(".")[2]] += t.numel()
    mlp_numel = block["gate"] + block["up"] + block["down"]
    attn_numel = block["q"] + block["k"] + block["v"] + block["o"]
    assert sizes["mlp"] == 4 * mlp_numel // config.layers
    assert sizes["attention"] == 4 * attn_numel // config.layers
    total = sum(t.numel() for t in w.values())
    assert sizes["other"] == 4 * (total - mlp_numel - attn_numel)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_llama_runs_on_the_gpu_as_transformers_does() -> None:
    hf, (config, w) = _hf(), _ours()
    ids = _prompt()
    layout = RingLayout("local", (4,), (FFN,), (T,))
    with exact_cuda() as gpu:
        on_gpu = {k: v.to(gpu) for k, v in w.items()}
        with torch.no_grad():
            logits = hmp.run(None, layout, on_gpu, config, ids.to(gpu))
        tokens = hmp.generate(None, layout, on_gpu, config, ids.to(gpu), NEW)
        profile = profile_blocks(config, 8, [2, 4], [FFN], [8], 2, compute=gpu)
    reference = _hf_logits(hf, ids)
    assert logits.device == gpu
    scale = float(reference.abs().max())
    assert float((logits.cpu() - reference).abs().max()) <= 1e-4 * scale
    assert tokens == _hf_generate(hf, ids)
    assert [n for n, _ in profile.mha] == [2, 4]


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_the_transformers_and_init_sources_build_llama_shapes(qkv_bias: bool) -> None:
    config = TransformerConfig(
        "decoder", 2, 48, 6, FFN, 100, 32, 1e-6, kv_heads=3, norm="rms", positions="rope",
        rope_theta=5e5, mlp="swiglu", qkv_bias=qkv_bias, o_bias=False, mlp_bias=False,
        tied_head=qkv_bias,
    )  # fmt: skip
    hf = sources.transformers_model(config, seed=2)
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    w = sources.transformers_weights(config, seed=2)
    ids = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward(ids, w, config), _hf_logits(hf, ids), rtol=0, atol=ATOL
        )
    layout = LAYOUTS["6q3kv"]["galaxy3-overlap"]
    heads, cols = row_offsets(list(layout.heads)), row_offsets(list(layout.cols))
    shards = [
        sources.init_shard(config, 4, range(heads[d], heads[d + 1]), range(cols[d], cols[d + 1]))
        for d in range(3)
    ]
    expected = model.generate(ids, model.init_weights(config, 4), config, NEW)
    got = run_on_ring(
        3,
        lambda r: hmp.generate(
            r, layout, shards[r.rank], config, ids, NEW, timeout_s=10, sharded=True
        ),
    )
    assert got == [expected] * 3
