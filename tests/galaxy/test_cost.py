"""Cost model: interpolation, straggler maxima, ring volumes, tile overlap and memory."""

import pytest
from pydantic import ValidationError

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.cost import memory_bytes, predict, ring_step_s
from services.worker.galaxy.profiling import random_layer

CONFIG = TransformerConfig("encoder", 2, 64, 4, 256, 100, 64, 1e-12)


def _profile(name, slow=1.0, seq_len=16):
    # linear in the share: 0.1 s per head, 0.8 s for all columns, 0.02 s for 16 rows
    return BlockProfile(
        device=name,
        seq_len=seq_len,
        mha=((4, 0.4 * slow),),
        mlp=((256, 0.8 * slow),),
        con=((16, 0.02 * slow),),
    )


PROFILES = {"a": _profile("a"), "b": _profile("b", 2.0)}


def _plan(mode, heads, cols, rows, devices=("a", "b"), seq_len=16, overlap=False):
    return InferencePlan(
        mode=mode,
        devices=list(devices),
        heads=heads,
        cols=cols,
        rows=rows,
        seq_len=seq_len,
        overlap=overlap,
    )


def test_interpolation_is_linear_through_zero_and_extends_the_last_segment():
    p = BlockProfile(
        device="x", seq_len=8, mha=((2, 1.0), (4, 3.0)), mlp=((1, 1.0),), con=((1, 1.0),)
    )
    assert [p.mha_s(x) for x in (0, 1, 2, 3, 4, 6)] == pytest.approx([0, 0.5, 1, 2, 3, 5])


@pytest.mark.parametrize(
    ("points", "match"),
    [
        ((), "at least one"),
        (((2, 1.0), (2, 2.0)), "strictly increasing"),
        (((0, 1.0),), ">= 1"),
        (((1, -1.0),), "seconds must be >= 0"),
    ],
)
def test_profile_points_are_validated(points, match):
    with pytest.raises(ValidationError, match=match):
        BlockProfile(device="x", seq_len=8, mha=points, mlp=((1, 1.0),), con=((1, 1.0),))
    with pytest.raises(ValidationError, match="mlp_open \\+ mlp_close must be <= 1"):
        BlockProfile(
            device="x",
            seq_len=8,
            mha=((1, 1.0),),
            mlp=((1, 1.0),),
            con=((1, 1.0),),
            mlp_open=0.6,
            mlp_close=0.6,
        )


def test_galaxy_straggler_max_and_ring_volume_by_hand():
    plan = _plan("galaxy", [3, 1], [192, 64], [8, 8])
    pred = predict(plan, CONFIG, PROFILES, bandwidth_bps=1e6)
    # per layer: MHA max(0.3, 0.2); MLP max(0.6, 0.4); 2 x CON max(0.01, 0.02)
    step = 8 * 64 * 4 * 8 / 1e6  # one tile of 8 rows: 16384 bits
    assert ring_step_s(8, 64, 1e6) == pytest.approx(step)
    assert pred.mha_s == pytest.approx(2 * 0.3)
    assert pred.mlp_s == pytest.approx(2 * 0.6)
    assert pred.con_s == pytest.approx(2 * 0.04)
    assert pred.comm_s == pytest.approx(2 * 4 * 1 * step)  # 2 AG + 2 RS of D-1 = 1 step
    assert pred.hidden_s == 0.0
    assert pred.total_s == pytest.approx(2 * (0.3 + 0.6 + 0.04 + 4 * step))


def test_three_device_rings_take_d_minus_1_steps_of_the_largest_tile():
    profs = {n: _profile(n, seq_len=12) for n in "xyz"}
    even = _plan("galaxy", [2, 1, 1], [86, 85, 85], [4, 4, 4], devices="xyz", seq_len=12)
    uneven = _plan("galaxy", [2, 1, 1], [86, 85, 85], [5, 4, 3], devices="xyz", seq_len=12)
    bps = 1e6
    assert predict(even, CONFIG, profs, bps).comm_s == pytest.approx(2 * 4 * 2 * 4 * 2048 / bps)
    assert predict(uneven, CONFIG, profs, bps).comm_s == pytest.approx(2 * 4 * 2 * 5 * 2048 / bps)
    sp = _plan("sp", [4] * 3, [256] * 3, [4, 4, 4], devices="xyz", seq_len=12)
    assert predict(sp, CONFIG, profs, bps).comm_s == pytest.approx(2 * 2 * 2 * 4 * 2048 / bps)


def test_megatron_all_reduce_is_reduce_scatter_plus_all_gather_and_replicates_con():
    plan = _plan("megatron", [2, 2], [128, 128], [16, 16])
    pred = predict(plan, CONFIG, PROFILES, bandwidth_bps=1e6)
    chunk = 16 / 2 * 64 * 4 * 8 / 1e6
    assert pred.comm_s == pytest.approx(2 * 2 * 2 * chunk)  # 2 AllReduce x (RS + AG)
    assert pred.mha_s == pytest.approx(2 * 0.4)  # b runs 2 heads at 0.2 s each
    assert pred.con_s == pytest.approx(2 * 2 * 0.04)  # all 16 rows on the slow device


def test_sp_runs_whole_blocks_on_its_rows_and_local_has_no_comm():
    sp = predict(_plan("sp", [4, 4], [256, 256], [8, 8]), CONFIG, PROFILES, 1e6)
    assert (sp.mha_s, sp.mlp_s) == pytest.approx((2 * 0.4, 2 * 0.8))  # b: half the rows at 2x
    local = InferencePlan(mode="local", devices=["a"], heads=[4], cols=[256], rows=[16], seq_len=16)
    pred = predict(local, CONFIG, PROFILES, 1e6)
    assert pred.comm_s == 0.0
    assert pred.total_s == pytest.approx(2 * (0.4 + 0.8 + 2 * 0.02))


def test_overlap_takes_the_max_of_tile_gemm_and_ring_step_by_hand():
    plan = _plan("galaxy", [3, 1], [192, 64], [8, 8], overlap=True)
    bps = 8 * 64 * 4 * 8 / 0.05  # one ring step takes 0.05 s
    pred = predict(plan, CONFIG, PROFILES, bps)
    # device a, MHA 0.3 s: QKV 0.15 (tiles of 0.075), middle 0.075, output 0.075 (tiles 0.0375)
    #   AllGather max(0.075, 0.05) + 0.075; ReduceScatter 0.0375 + max(0.0375, 0.05)
    mha_a = (0.075 + 0.075) + 0.075 + (0.0375 + 0.05)
    # device b, MHA 0.2 s: (0.05 + 0.05) + 0.05 + (0.025 + 0.05) is less
    mlp_a = (0.15 + 0.15) + 0.0 + (0.15 + 0.15)  # the GEMM tiles hide both steps
    without = 0.3 + 0.6 + 4 * 0.05
    assert pred.comm_s == pytest.approx(2 * 4 * 0.05)
    assert pred.hidden_s == pytest.approx(2 * (without - mha_a - mlp_a))
    assert pred.total_s == pytest.approx(2 * (mha_a + mlp_a + 0.04))
    assert 0 < pred.hidden_s <= pred.comm_s


@pytest.mark.parametrize(
    ("profiles", "bps", "match"),
    [
        ({"a": _profile("a")}, 1e6, "no block profile for device 'b'"),
        ({"a": _profile("a"), "b": _profile("b", seq_len=8)}, 1e6, "seq_len 8, plan has 16"),
        (PROFILES, 0.0, "bandwidth must be positive"),
    ],
)
def test_predict_refuses_what_it_cannot_price(profiles, bps, match):
    with pytest.raises(ConfigError, match=match):
        predict(_plan("galaxy", [3, 1], [192, 64], [8, 8]), CONFIG, profiles, bps)


def test_memory_counts_the_real_tensors():
    layer = random_layer(CONFIG)
    per_layer = sum(t.numel() for t in layer.values())
    h, t = CONFIG.hidden, 16
    embeddings = (CONFIG.vocab_size + CONFIG.max_positions) * h + 2 * h  # + embed.norm
    acts = 4 * t * h + 3 * t * h + CONFIG.heads * t * t + t * CONFIG.ffn
    local = InferencePlan(mode="local", devices=["a"], heads=[4], cols=[256], rows=[16], seq_len=16)
    assert memory_bytes(local, CONFIG) == [4 * (CONFIG.layers * per_layer + embeddings + acts)]
    # split evenly, each device holds half of every layer's sharded weights (LayerNorms whole)
    mlm = memory_bytes(_plan("megatron", [2, 2], [128, 128], [16, 16]), CONFIG)
    ln = 4 * h
    half_shards = CONFIG.layers * (per_layer - ln) // 2
    half_acts = 4 * t * h + 3 * t * h // 2 + 2 * t * t + t * 128
    assert mlm == [4 * (half_shards + CONFIG.layers * ln + embeddings + half_acts)] * 2
    # sequence parallelism holds everything, with activations for its query rows
    sp = memory_bytes(_plan("sp", [4, 4], [256, 256], [8, 8]), CONFIG)
    assert sp[0] > mlm[0] and sp[0] == sp[1]
    assert memory_bytes(local, CONFIG, dtype_bytes=2)[0] * 2 == memory_bytes(local, CONFIG)[0]
