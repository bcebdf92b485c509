"""Galaxy's profiler: time each block of one layer on this machine at a few shares.

The planner needs `L(block, share, d)` for every device; we measure this
machine's core on random weights (timings do not depend on their values) and
emulate slower devices by scaling (`scaled`), as the presets' slowdowns say.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from common.accelerator import synchronize
from common.errors import ConfigError
from common.galaxy.config import TransformerConfig, layer_key
from common.galaxy.profile import BlockProfile
from services.lib.galaxy import blocks
from services.lib.galaxy.weights import expected_shapes

__all__ = ["profile_blocks", "random_layer", "scaled"]


def random_layer(config: TransformerConfig, seed: int = 0) -> dict[str, Tensor]:
    """Layer 0's tensors under their model-wide names, random but shaped as the config says.

    Exactly the tensors the served model's layers have (`expected_shapes`): GQA's
    narrower keys and values, SwiGLU's gate, and no biases where it has none.
    """
    gen = torch.Generator().manual_seed(seed)
    prefix = layer_key(0, "")
    return {
        name: torch.randn(shape, generator=gen) * 0.02
        for name, shape in expected_shapes(config).items()
        if name.startswith(prefix)
    }


def _whole_groups(counts: Sequence[int], config: TransformerConfig) -> list[int]:
    """Head counts rounded up to whole KV groups: plans split heads in groups only."""
    g = config.group_size
    return [min(config.heads, -(-n // g) * g) for n in counts]


def _qkv(x: Tensor, w: dict[str, Tensor], heads: range, config: TransformerConfig) -> Tensor:
    """The MHA block's opening GEMM as served: projections, then rotary positions."""
    q, k, _ = blocks.qkv(x, w, 0, heads, config)
    return blocks.rotate(q, k, 0, config)[0]


def _median_s(fn: Callable[[], object], repeats: int, on: torch.device | None = None) -> float:
    on = on or torch.device("cpu")
    fn()  # warm-up: first calls pay allocation and dispatch costs a steady run does not
    times = []
    for _ in range(repeats):
        synchronize(on)
        start = time.perf_counter()
        fn()
        synchronize(on)  # a GPU runs asynchronously: time the work, not its launch
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sizes(name: str, values: Sequence[int], top: int) -> list[int]:
    sizes = sorted(set(values))
    if not sizes or sizes[0] < 1 or sizes[-1] > top:
        raise ConfigError(f"{name} must be non-empty and within [1, {top}], got {list(values)}")
    return sizes


def profile_blocks(
    config: TransformerConfig,
    seq_len: int,
    head_counts: Sequence[int],
    col_counts: Sequence[int],
    row_counts: Sequence[int],
    repeats: int = 5,
    *,
    device: str = "local",
    seed: int = 0,
    compute: torch.device | None = None,
) -> BlockProfile:
    """Median seconds of this machine's MHA, MLP and connective blocks at the given shares.

    A block's time is the sum of its parts' medians (QKV, attention, output GEMM;
    up, down GEMM); head counts are rounded up to whole KV groups (a plan never
    gives a device part of one); the first and last GEMM's shares of it are taken at the largest
    size measured, which is what tile overlap hides communication under.
    `compute` is where the blocks run (the CPU by default), as served blocks will.

    Raises:
        ConfigError: If a count is outside the model, seq_len passes max_positions,
            or repeats < 1.

    """
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if not 1 <= seq_len <= config.max_positions:
        raise ConfigError(f"seq_len must be in [1, {config.max_positions}], got {seq_len}")
    heads = _sizes("head_counts", _whole_groups(head_counts, config), config.heads)
    cols = _sizes("col_counts", col_counts, config.ffn)
    rows = _sizes("row_counts", row_counts, seq_len)
    on = compute or torch.device("cpu")
    w = {name: t.to(on) for name, t in random_layer(config, seed).items()}
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(seq_len, config.hidden, generator=gen).to(on)
    mha: list[tuple[int, float]] = []
    mha_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)
    with torch.inference_mode():
        for n in heads:
            q, k, v = blocks.qkv(x, w, 0, range(n), config)
            q, k = blocks.rotate(q, k, 0, config)
            ctx = blocks.attend(q, k, v, config.causal, 0)
            mha_parts = (
                _median_s(partial(_qkv, x, w, range(n), config), repeats, on),
                _median_s(partial(blocks.attend, q, k, v, config.causal, 0), repeats, on),
                _median_s(partial(blocks.out_partial, ctx, w, 0, range(n)), repeats, on),
            )
            mha.append((n, sum(mha_parts)))
        mlp: list[tuple[int, float]] = []
        mlp_parts = (0.0, 0.0)
        for n in cols:
            e = blocks.mlp_up(x, w, 0, range(n), config)
            mlp_parts = (
                _median_s(partial(blocks.mlp_up, x, w, 0, range(n), config), repeats, on),
                _median_s(partial(blocks.mlp_down_partial, e, w, 0, range(n)), repeats, on),
            )
            mlp.append((n, sum(mlp_parts)))
        con: list[tuple[int, float]] = []
        for n in rows:
            # the two connective blocks of a layer differ (post-attention, post-MLP plus
            # the next layer's input norm); one "connective block" is their mean
            after_attn = _median_s(
                partial(blocks.after_attention, x[:n], x[:n], w, 0, config), repeats, on
            )
            after_mlp = _median_s(partial(_after_mlp, x[:n], w, config), repeats, on)
            con.append((n, (after_attn + after_mlp) / 2))
    return BlockProfile(
        device=device,
        seq_len=seq_len,
        mha=tuple(mha),
        mlp=tuple(mlp),
        con=tuple(con),
        mha_open=_share(mha_parts[0], sum(mha_parts)),
        mha_close=_share(mha_parts[2], sum(mha_parts)),
        mlp_open=_share(mlp_parts[0], sum(mlp_parts)),
        mlp_close=_share(mlp_parts[1], sum(mlp_parts)),
    )


def _after_mlp(x: Tensor, w: dict[str, Tensor], config: TransformerConfig) -> Tensor:
    return blocks.attention_input(blocks.after_mlp(x, x, w, 0, config), w, 0, config)


def _share(part: float, total: float) -> float:
    return part / total if total > 0 else 0.0


def scaled(profile: BlockProfile, slowdown: float, device: str | None = None) -> BlockProfile:
    """`profile` as a device `slowdown` times slower would measure it (same shares).

    Raises:
        ConfigError: If `slowdown` is not positive.

    """
    if not slowdown > 0:
        raise ConfigError(f"slowdown must be positive, got {slowdown}")

    def times(points: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        return tuple((n, s * slowdown) for n, s in points)

    return profile.model_copy(
        update={
            "device": profile.device if device is None else device,
            "mha": times(profile.mha),
            "mlp": times(profile.mlp),
            "con": times(profile.con),
            "step_s": profile.step_s * slowdown,
            "layer_s": profile.layer_s * slowdown,
        }
    )
