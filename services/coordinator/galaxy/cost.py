"""What a plan costs: per-request latency from block profiles, and memory per device.

Latency follows Galaxy §III-C/D: each parallel block ends at a synchronisation
point, so it takes as long as its slowest device (Eq. 4); ring collectives move
one tile of `rows * hidden * 4` bytes per step for `D - 1` steps (an AllReduce
is a ReduceScatter then an AllGather); with tile overlap each ring step runs
under one tile's GEMM, so a step costs `max(tile GEMM, transfer)`. Memory is
Eq. 5's left-hand side plus what every device holds besides its shards.

Measured on the testbed, a ring step also costs a fixed time beyond its bytes:
the sender's framing and copy, two thread hops, the receiver's wakeup, and on a
CPU-quota'd device the wait for its next scheduling period. That part is
`step_latency_s` (the link's) plus the slowest ring member's `BlockProfile.step_s`
(its own CPU work per step); it runs on the same core as the GEMMs, so tile
overlap does not hide it. Each device's `BlockProfile.layer_s` adds the Python
and dispatch work of one layer outside its blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile

__all__ = [
    "Prediction",
    "device_memory_bytes",
    "memory_bytes",
    "predict",
    "ring_step_s",
]


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one request, summed over layers.

    Attributes:
        mha_s: Straggler MHA time (Eq. 4).
        mlp_s: Straggler MLP time.
        con_s: Straggler time of the two connective blocks per layer.
        comm_s: Ring communication time if nothing overlaps it.
        hidden_s: Part of `comm_s` hidden under tile GEMMs (0 without overlap).
        total_s: `mha_s + mlp_s + con_s + comm_s - hidden_s`.

    """

    mha_s: float
    mlp_s: float
    con_s: float
    comm_s: float
    hidden_s: float
    total_s: float


def ring_step_s(rows: float, hidden: int, bandwidth_bps: float) -> float:
    """Seconds to pass one tile of `rows` fp32 rows to the next device in the ring."""
    return rows * hidden * 4 * 8 / bandwidth_bps


def _profiles_for(plan: InferencePlan, profiles: Mapping[str, BlockProfile]) -> list[BlockProfile]:
    out = []
    for name in plan.devices:
        prof = profiles.get(name)
        if prof is None:
            raise ConfigError(f"no block profile for device {name!r}; have {sorted(profiles)}")
        if prof.seq_len != plan.seq_len:
            raise ConfigError(
                f"profile of {name!r} is for seq_len {prof.seq_len}, plan has {plan.seq_len}"
            )
        out.append(prof)
    return out


def _overlapped(
    open_s: float, mid_s: float, close_s: float, tiles: Sequence[float], d: int, step: float
) -> float:
    """One device's TP block with the AllGather before and ReduceScatter after overlapped.

    §III-D: at AllGather step k device d multiplies tile (d - k) while passing it on
    (no transfer at the last step); at ReduceScatter step k it multiplies tile
    (d - 1 - k) while passing the previous partial sum on (none at the first step).
    """
    n = len(tiles)
    gather = sum(max(open_s * tiles[(d - k) % n], step if k < n - 1 else 0.0) for k in range(n))
    scatter = sum(max(close_s * tiles[(d - 1 - k) % n], step if k else 0.0) for k in range(n))
    return gather + mid_s + scatter


def predict(
    plan: InferencePlan,
    config: TransformerConfig,
    profiles: Mapping[str, BlockProfile],
    bandwidth_bps: float,
    *,
    step_latency_s: float = 0.0,
) -> Prediction:
    """Seconds one request takes under `plan`, from per-device block profiles.

    Per layer: galaxy runs AllGather, MHA, ReduceScatter, connective, then the same
    around the MLP; megatron an AllReduce after MHA and after MLP with replicated
    connective blocks; sp one AllGather (keys and values side by side) with each device running
    whole blocks on its rows (time scaled by rows / seq_len); local no communication.

    Every ring step adds `step_latency_s` and the slowest member's `step_s`
    (see the module doc); every layer the slowest member's `layer_s`.

    Raises:
        ConfigError: If the plan does not cover the model, a device has no profile
            for the plan's seq_len, or the bandwidth or step latency is out of range.

    """
    plan.check(config)
    if not bandwidth_bps > 0:
        raise ConfigError(f"bandwidth must be positive bits/s, got {bandwidth_bps}")
    if not step_latency_s >= 0:
        raise ConfigError(f"step latency must be >= 0 s, got {step_latency_s}")
    profs = _profiles_for(plan, profiles)
    n, t, hidden = len(plan.devices), plan.seq_len, config.hidden
    if plan.mode == "sp":
        mha = max(p.mha_s(config.heads) * r / t for p, r in zip(profs, plan.rows, strict=True))
        mlp = max(p.mlp_s(config.ffn) * r / t for p, r in zip(profs, plan.rows, strict=True))
    else:
        mha = max(p.mha_s(a) for p, a in zip(profs, plan.heads, strict=True))
        mlp = max(p.mlp_s(b) for p, b in zip(profs, plan.cols, strict=True))
    con = 2 * max(p.con_s(r) for p, r in zip(profs, plan.rows, strict=True))
    con += max(p.layer_s for p in profs)
    fixed = step_latency_s + max(p.step_s for p in profs)
    if n == 1:
        comm, step, steps = 0.0, 0.0, 0
    elif plan.mode == "megatron":
        # an AllReduce of the (t, hidden) output in D even chunks is RS + AG: 2 (D-1) steps
        step = ring_step_s(t / n, hidden, bandwidth_bps)
        steps = 2 * 2 * (n - 1)
    elif plan.mode == "galaxy":
        # 2 AllGather + 2 ReduceScatter; a step moves the largest tile
        step = ring_step_s(max(plan.rows), hidden, bandwidth_bps)
        steps = 4 * (n - 1)
    else:
        # sp: one AllGather of keys and values together, a tile twice as wide
        step = ring_step_s(max(plan.rows), 2 * hidden, bandwidth_bps)
        steps = n - 1
    comm = steps * (step + fixed)
    hidden_s = 0.0
    if plan.overlap and n > 1:
        tiles = [r / t for r in plan.rows]
        blocks = []
        for kind, shares in (("mha", plan.heads), ("mlp", plan.cols)):
            worst = 0.0
            for d, (p, share) in enumerate(zip(profs, shares, strict=True)):
                total = p.mha_s(share) if kind == "mha" else p.mlp_s(share)
                o, c = getattr(p, f"{kind}_open") * total, getattr(p, f"{kind}_close") * total
                worst = max(worst, _overlapped(o, total - o - c, c, tiles, d, step))
            blocks.append(worst)
        # only the transfers hide: the fixed part runs on the GEMMs' own core
        hidden_s = config.layers * max(0.0, mha + mlp + steps * step - sum(blocks))
    layers = config.layers
    total = layers * (mha + mlp + con + comm) - hidden_s
    return Prediction(layers * mha, layers * mlp, layers * con, layers * comm, hidden_s, total)


def device_memory_bytes(
    config: TransformerConfig,
    seq_len: int,
    heads: int,
    cols: int,
    rows: int,
    *,
    query_rows_only: bool = False,
    dtype_bytes: int = 4,
) -> int:
    """Peak bytes of one device holding `heads` heads and `cols` MLP columns of every layer.

    Eq. 5's `l * (M_att * a_d / sum A + M_mlp * b_d / sum B)` for the sharded
    weights (`TransformerConfig.param_counts`: GQA, SwiGLU, absent biases and an
    untied head counted), plus the embeddings, norms and head every device keeps,
    plus one layer's working activations (inference frees them layer by layer):
    the residual rows, this device's Q/K/V, attention scores and MLP hidden
    columns, for `rows` query rows when `query_rows_only` (sequence
    parallelism), else all.
    """
    h, t, hd = config.hidden, seq_len, config.head_dim
    counts = config.param_counts()
    m_att, m_mlp = counts["attention"], counts["mlp"]
    shards = config.layers * (m_att * heads * config.ffn + m_mlp * cols * config.heads)
    params = -(-shards // (config.heads * config.ffn)) + counts["other"]
    tq = rows if query_rows_only else t
    # queries of its heads, keys and values of their KV groups (GQA: fewer), scores
    kv_heads = -(-heads // config.group_size)
    qkv = hd * (heads * tq + 2 * kv_heads * t)
    mlp_hidden = tq * cols * (2 if config.activation == "swiglu" else 1)  # gate and up
    acts = 4 * t * h + qkv + heads * tq * t + mlp_hidden
    return dtype_bytes * (params + acts)


def memory_bytes(plan: InferencePlan, config: TransformerConfig, dtype_bytes: int = 4) -> list[int]:
    """Peak bytes each device of `plan` needs to serve one request (`device_memory_bytes`)."""
    plan.check(config)
    return [
        device_memory_bytes(
            config,
            plan.seq_len,
            a,
            b,
            r,
            query_rows_only=plan.mode == "sp",
            dtype_bytes=dtype_bytes,
        )
        for a, b, r in zip(plan.heads, plan.cols, plan.rows, strict=True)
    ]
