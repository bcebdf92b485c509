"""Plans for grouped-query attention: heads split in whole KV groups, memory of Llama shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.cost import device_memory_bytes
from services.coordinator.galaxy.planner import plan_galaxy, plan_megatron
from services.lib.galaxy.model import weight_bytes

SEQ = 16
BIG = 1 << 40
LLAMA = TransformerConfig(
    "decoder", 2, 128, 8, 384, 512, 64, 1e-5, kv_heads=2, norm="rms", positions="rope",
    mlp="swiglu", qkv_bias=False, o_bias=False, mlp_bias=False, tied_head=False,
)  # fmt: skip
"""8 query heads in 2 groups of 4."""


def _profile(name: str, slow: float) -> BlockProfile:
    return BlockProfile(
        device=name,
        seq_len=SEQ,
        mha=((LLAMA.heads, 0.6 * slow),),
        mlp=((LLAMA.ffn, 0.9 * slow),),
        con=((SEQ, 0.01 * slow),),
    )


@settings(max_examples=40, deadline=None)
@given(
    slows=st.lists(st.floats(0.2, 5.0), min_size=1, max_size=5),
    tight=st.lists(st.floats(0.3, 1.0), min_size=5, max_size=5),
)
def test_galaxy_plans_never_cut_a_kv_group(slows: list[float], tight: list[float]) -> None:
    names = [f"d{i}" for i in range(len(slows))]
    whole = device_memory_bytes(LLAMA, SEQ, LLAMA.heads, LLAMA.ffn, SEQ)
    fixed = device_memory_bytes(LLAMA, SEQ, 0, 0, 0)
    # budgets between "the fixed part" and "the whole model": memory balancing moves heads
    budgets = {n: int(fixed + (whole - fixed) * t) for n, t in zip(names, tight, strict=False)}
    profiles = {n: _profile(n, s) for n, s in zip(names, slows, strict=True)}
    try:
        plan = plan_galaxy(LLAMA, names, profiles, budgets, SEQ)
    except PlanError:
        return  # no split fits: nothing to check
    assert sum(plan.heads) == LLAMA.heads
    assert all(h % LLAMA.group_size == 0 for h in plan.heads), plan.heads


def test_faster_devices_get_more_groups_and_megatron_splits_groups_evenly() -> None:
    names = ["fast", "slow"]
    profiles = {"fast": _profile("fast", 1.0), "slow": _profile("slow", 3.0)}
    plan = plan_galaxy(LLAMA, names, profiles, dict.fromkeys(names, BIG), SEQ)
    assert plan.heads == [8, 0] or plan.heads == [4, 4]
    assert plan_megatron(LLAMA, ["a", "b"], SEQ).heads == [4, 4]
    assert plan_megatron(LLAMA, ["a", "b", "c"], SEQ).heads in ([4, 4, 0], [4, 0, 4], [0, 4, 4])


def test_a_plan_that_cuts_a_kv_group_is_refused_naming_the_devices() -> None:
    plan = InferencePlan(
        mode="galaxy", devices=["a", "b"], heads=[6, 2], cols=[192, 192], rows=[8, 8], seq_len=SEQ
    )
    with pytest.raises(
        ConfigError, match=r"cut a key/value group of 4 query heads on \['a', 'b'\]"
    ):
        plan.check(LLAMA)
    sp = InferencePlan(
        mode="sp", devices=["a", "b"], heads=[8, 8], cols=[384, 384], rows=[8, 8], seq_len=SEQ
    )
    sp.check(LLAMA)  # replicated heads cut nothing


def test_memory_counts_gqa_swiglu_and_the_untied_head() -> None:
    def need(config: TransformerConfig) -> int:
        return device_memory_bytes(config, SEQ, config.heads, config.ffn, SEQ)

    h, f, t = LLAMA.hidden, LLAMA.ffn, SEQ
    mha = replace(LLAMA, kv_heads=None)
    # 6 query heads' worth of key and value rows fewer per layer, and their activations
    kv_rows = 2 * (LLAMA.heads - 2) * LLAMA.head_dim
    assert need(mha) - need(LLAMA) == 4 * (LLAMA.layers * kv_rows * h + kv_rows * t)
    assert need(LLAMA) - need(replace(LLAMA, tied_head=True)) == 4 * LLAMA.vocab_size * h
    # SwiGLU: one more (ffn, hidden) matrix per layer and the gate's activations
    assert need(LLAMA) - need(replace(LLAMA, mlp="gelu_tanh")) == 4 * (LLAMA.layers * f * h + t * f)
    assert weight_bytes(LLAMA)["attention"] == 4 * (2 * h * h + 2 * LLAMA.kv_hidden * h)
