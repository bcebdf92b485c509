"""The block profiler: medians of repeats, block sums and shares, and emulated slow devices."""

import itertools

import pytest

from common.errors import ConfigError
from common.galaxy.config import LAYER_KEYS, TransformerConfig, layer_key
from services.coordinator.galaxy.cost import predict
from services.coordinator.galaxy.planner import plan_galaxy
from services.worker.galaxy import profiling
from services.worker.galaxy.profiling import profile_blocks, random_layer, scaled

CONFIG = TransformerConfig("decoder", 2, 64, 4, 256, 128, 64, 1e-5)
ENCODER = TransformerConfig("encoder", 2, 64, 4, 256, 128, 64, 1e-12)
LLAMA = TransformerConfig(
    "decoder",
    2,
    64,
    4,
    96,
    128,
    64,
    1e-5,
    kv_heads=2,
    norm="rms",
    positions="rope",
    mlp="swiglu",
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    tied_head=False,
)


def _flat(points):
    return [x for point in points for x in point]


def test_random_layer_has_every_tensor_in_nn_linear_shape():
    w = random_layer(CONFIG)
    h, f = CONFIG.hidden, CONFIG.ffn
    expected = {"up.weight": (f, h), "up.bias": (f,), "down.weight": (h, f)}
    for name in ("q", "k", "v", "o"):
        expected[f"{name}.weight"] = (h, h)
    names = [n for n in LAYER_KEYS if not n.startswith("gate.")]  # GELU: no gate
    assert set(w) == {layer_key(0, n) for n in names}
    for n in names:
        assert tuple(w[layer_key(0, n)].shape) == expected.get(n, (h,))
    assert all(t.equal(u) for t, u in zip(w.values(), random_layer(CONFIG).values(), strict=True))


def test_a_llama_layer_is_profiled_in_whole_kv_groups():
    w = random_layer(LLAMA)
    assert tuple(w[layer_key(0, "k.weight")].shape) == (32, 64)  # 2 KV heads of width 16
    assert layer_key(0, "gate.weight") in w and layer_key(0, "q.bias") not in w
    p = profile_blocks(LLAMA, 8, [1, 3, 4], [16], [8], repeats=1)
    assert [n for n, _ in p.mha] == [2, 4]


def test_blocks_are_medians_of_repeats_summed_over_their_parts(monkeypatch):
    # a clock whose start/stop pairs measure 3 ms, 1 ms, 2 ms, ... : every median is 2 ms
    durations = itertools.cycle([0.003, 0.001, 0.002])
    now = [0.0]
    started = [False]

    def clock():
        if started[0]:
            now[0] += next(durations)
        started[0] = not started[0]
        return now[0]

    monkeypatch.setattr(profiling.time, "perf_counter", clock)
    p = profile_blocks(CONFIG, 16, [1, 4], [64, 256], [4, 16], repeats=3, device="x")
    assert p.device == "x" and p.seq_len == 16
    assert _flat(p.mha) == pytest.approx([1, 0.006, 4, 0.006])  # QKV + attention + out GEMM
    assert _flat(p.mlp) == pytest.approx([64, 0.004, 256, 0.004])  # up + down
    assert _flat(p.con) == pytest.approx([4, 0.002, 16, 0.002])  # mean of the two per layer
    assert (p.mha_open, p.mha_close) == pytest.approx((1 / 3, 1 / 3))
    assert (p.mlp_open, p.mlp_close) == pytest.approx((0.5, 0.5))


@pytest.mark.parametrize("config", [CONFIG, ENCODER])
def test_a_real_profile_prices_plans_and_scaling_drives_the_split(config):
    p = profile_blocks(config, 16, [2, 4], [128, 256], [8, 16], repeats=2, device="ref")
    assert [n for n, _ in p.mha] == [2, 4] and all(s > 0 for _, s in p.mha + p.mlp + p.con)
    assert 0 < p.mha_open + p.mha_close <= 1 and 0 < p.mlp_open + p.mlp_close <= 1
    slow = scaled(p, 3.0, device="slow")
    assert _flat(slow.mlp) == pytest.approx([x for n, s in p.mlp for x in (n, 3 * s)])
    assert (slow.device, slow.mha_open, slow.seq_len) == ("slow", p.mha_open, 16)
    profiles = {"ref": p, "slow": slow}
    plan = plan_galaxy(config, ["ref", "slow"], profiles, {"ref": 1 << 40, "slow": 1 << 40}, 16)
    assert (plan.heads, plan.cols) == ([3, 1], [192, 64])  # capacities 3 : 1
    assert predict(plan, config, profiles, 125e6).total_s > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_counts": [0, 4]}, r"head_counts must be non-empty and within \[1, 4\]"),
        ({"col_counts": [512]}, r"col_counts must be .* within \[1, 256\], got \[512\]"),
        ({"row_counts": []}, "row_counts must be non-empty"),
        ({"repeats": 0}, "repeats must be >= 1, got 0"),
        ({"seq_len": 65, "row_counts": [1]}, r"seq_len must be in \[1, 64\], got 65"),
    ],
)
def test_profile_blocks_refuses_bad_counts(kwargs, match):
    args = {
        "seq_len": 8,
        "head_counts": [1],
        "col_counts": [8],
        "row_counts": [8],
        "repeats": 1,
        **kwargs,
    }
    with pytest.raises(ConfigError, match=match):
        profile_blocks(CONFIG, **args)
    with pytest.raises(ConfigError, match="slowdown must be positive"):
        scaled(profile_blocks(CONFIG, 8, [1], [8], [8], 1), 0.0)
