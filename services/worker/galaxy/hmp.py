"""One device's part of a distributed Transformer forward: Galaxy HMP and its baselines.

Every device of the ring calls `run` with the same layout, weights and token
ids; together they compute what `model.forward` computes on one device:

- galaxy (§III-B): heads and MLP columns split for the MHA and MLP blocks,
  sequence rows split for the connective blocks; AllGather into each block and
  ReduceScatter out of it, tiled against the GEMMs when `overlap` (§III-D).
- megatron: heads and columns split, every device keeps all rows and runs the
  connective blocks redundantly; an AllReduce closes each block.
- sp: every device holds the whole model and runs its own rows; the keys and
  values of all rows are gathered (two AllGathers per MHA block).
- local: one device runs `model.forward`.

Llama-family models run in every mode too: rotary positions are applied where
the rows' positions are known (after the gather in galaxy, on own rows before
the key/value gather in sp), and under grouped-query attention heads are split
in whole KV groups, so a device's query heads find their keys and values on
the device itself and its KV cache holds only its own groups.

Every device returns the same logits (bit for bit): the final hidden rows are
gathered everywhere, so a decode loop on each device picks the same next token
without another message. A call with fewer rows than planned (a decode step)
splits them in proportion to the plan (`collectives.placement`): one new token
runs its connective blocks on the device planned for the most rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy import blocks, model
from services.lib.galaxy.sampling import GREEDY, Sampler
from services.worker.galaxy.collectives import (
    DEFAULT_TIMEOUT_S,
    all_gather,
    gather_gemm,
    gemm_all_reduce,
    gemm_scatter,
    placement,
    row_offsets,
)
from services.worker.galaxy.ring import Ring

__all__ = ["Layout", "RingLayout", "generate", "new_cache", "run"]

_MODES = ("galaxy", "megatron", "sp", "local")


class Layout(Protocol):
    """Per-device shares in ring order, as `plan.InferencePlan` states them.

    `heads[d]` / `cols[d]` split the MHA / MLP weights (galaxy, megatron; ignored
    by sp and local, which hold all of them); `rows[d]` splits the sequence for the
    connective blocks (galaxy, sp; megatron and local run every row).
    """

    @property
    def mode(self) -> str:
        """One of galaxy, megatron, sp, local."""
        ...

    @property
    def heads(self) -> Sequence[int]:
        """Attention heads per device."""
        ...

    @property
    def cols(self) -> Sequence[int]:
        """MLP columns per device."""
        ...

    @property
    def rows(self) -> Sequence[int]:
        """Sequence rows per device for the connective blocks."""
        ...

    @property
    def overlap(self) -> bool:
        """Whether the collectives run tiled under the GEMMs."""
        ...


@dataclass(frozen=True)
class RingLayout:
    """A `Layout` without a planner: the shares written down by hand."""

    mode: str
    heads: tuple[int, ...]
    cols: tuple[int, ...]
    rows: tuple[int, ...]
    overlap: bool = False


@dataclass(frozen=True)
class _Step:
    """What one device needs for one call: its shares, everyone's rows, ring, cache."""

    ring: Ring
    w: Mapping[str, Tensor]
    cfg: TransformerConfig
    mode: str
    heads: range
    cols: range
    wheads: range
    """Where this device's heads sit in `w`: `heads` itself, or from 0 in sharded weights."""
    wcols: range
    """Where this device's MLP columns sit in `w`, likewise."""
    counts: list[int]
    start: int
    offset: int
    cache: model.KVCache | None
    overlap: bool
    timeout_s: float

    def gather(self, tag: str, x: Tensor, gemm: Callable[[Tensor], Tensor]) -> Tensor:
        """`gemm` of everyone's rows `x` (AllGather-then-GEMM)."""
        return gather_gemm(
            self.ring, tag, x, self.counts, gemm, overlap=self.overlap, timeout_s=self.timeout_s
        )

    def scatter(self, tag: str, x: Tensor, gemm: Callable[[Tensor], Tensor]) -> Tensor:
        """Own rows of the sum of `gemm(x)` over devices (GEMM-then-ReduceScatter)."""
        return gemm_scatter(
            self.ring, tag, x, self.counts, gemm, overlap=self.overlap, timeout_s=self.timeout_s
        )

    def reduce(self, tag: str, x: Tensor, gemm: Callable[[Tensor], Tensor]) -> Tensor:
        """The sum of `gemm(x)` over devices on every device (GEMM-then-AllReduce)."""
        return gemm_all_reduce(
            self.ring, tag, x, None, gemm, overlap=self.overlap, timeout_s=self.timeout_s
        )


def _share(counts: Sequence[int], rank: int, total: int, what: str) -> range:
    if sum(counts) != total or any(c < 0 for c in counts):
        raise ConfigError(f"{what} per device must be >= 0 and sum to {total}, got {list(counts)}")
    off = row_offsets(counts)
    return range(off[rank], off[rank + 1])


def _prepare(
    ring: Ring,
    layout: Layout,
    w: Mapping[str, Tensor],
    config: TransformerConfig,
    ids: Tensor,
    cache: model.KVCache | None,
    timeout_s: float,
    sharded: bool,
) -> _Step:
    """Check the layout against the ring, the model and the cache; cut out this device's part."""
    if layout.mode not in _MODES:
        raise ConfigError(f"mode must be one of {_MODES}, got {layout.mode!r}")
    if ids.dim() != 1 or ids.shape[0] < 1:
        raise ConfigError(f"ids must be 1-D and non-empty, got shape {tuple(ids.shape)}")
    world, rank, t = ring.world, ring.rank, ids.shape[0]
    for name in ("heads", "cols", "rows"):
        if len(getattr(layout, name)) != world:
            raise ConfigError(
                f"layout {name} has {len(getattr(layout, name))} entries, ring has {world} devices"
            )
    split_weights = layout.mode in ("galaxy", "megatron")
    split_rows = layout.mode in ("galaxy", "sp")
    heads = _share(layout.heads, rank, config.heads, "heads") if split_weights else None
    cols = _share(layout.cols, rank, config.ffn, "cols") if split_weights else None
    heads = heads if heads is not None else range(config.heads)
    config.kv_range(heads)  # a share that cuts a KV group is refused here, named
    counts = placement(layout.rows, t) if split_rows else [t] * world
    if cache is not None and (cache.config != config or cache.heads != heads):
        raise ConfigError(f"device {rank} needs a cache of heads {heads}, got {cache.heads}")
    cols = cols if cols is not None else range(config.ffn)
    return _Step(
        ring=ring,
        w=w,
        cfg=config,
        mode=layout.mode,
        heads=heads,
        cols=cols,
        wheads=range(len(heads)) if sharded else heads,
        wcols=range(len(cols)) if sharded else cols,
        counts=counts,
        start=row_offsets(counts)[rank] if split_rows else 0,
        offset=cache.length if cache is not None else 0,
        cache=cache,
        overlap=layout.overlap,
        timeout_s=timeout_s,
    )


def new_cache(layout: Layout, rank: int, config: TransformerConfig) -> model.KVCache:
    """The KV cache device `rank` keeps: its own heads (galaxy, megatron) or all (sp, local).

    Under grouped-query attention that is its heads' KV groups. A device without
    heads keeps an empty one, which still counts the decode position.

    Raises:
        ConfigError: If its heads cut a KV group, or the model is an encoder.

    """
    if layout.mode not in ("galaxy", "megatron"):
        return model.KVCache(config)
    return model.KVCache(config, _share(layout.heads, rank, config.heads, "heads"))


def run(
    ring: Ring | None,
    layout: Layout,
    w: Mapping[str, Tensor],
    config: TransformerConfig,
    ids: Tensor,
    cache: model.KVCache | None = None,
    *,
    tag: str = "fwd",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sharded: bool = False,
) -> Tensor:
    """One device's part of `model.forward(ids, w, config, cache)`; returns the same output.

    With a cache (see `new_cache`), `ids` are the new tokens only. `tag` keeps the
    messages of concurrent requests on one ring apart; decode steps are told apart
    by their position. `sharded`: `w` holds only this device's heads and MLP
    columns, numbered from 0 (`sources.shard`), as a device that cannot hold the
    whole model keeps them.

    Raises:
        ConfigError: If the layout does not fit the ring or the model, or the cache
            does not hold this device's heads.
        RoundTimeoutError: If a ring neighbour stays silent for `timeout_s`.

    """
    if layout.mode == "local" or ring is None:
        if layout.mode != "local" or len(layout.rows) != 1:
            raise ConfigError(f"only a 1-device local layout runs without a ring, got {layout}")
        return model.forward(ids, w, config, cache)
    s = _prepare(ring, layout, w, config, ids, cache, timeout_s, sharded)
    tag = f"{tag}@{s.offset}"
    x = blocks.embed(ids[s.start : s.start + s.counts[ring.rank]], w, config, s.offset + s.start)
    layer_fn = {"galaxy": _galaxy_layer, "megatron": _megatron_layer, "sp": _sp_layer}[s.mode]
    for i in range(config.layers):
        x = layer_fn(s, i, x, f"{tag}/L{i}")
    if s.mode != "megatron":
        x = all_gather(ring, f"{tag}/out", x, s.counts, timeout_s=timeout_s)
    return blocks.head(x, w, config)


def _attend(s: _Step, i: int, q: Tensor, k: Tensor, v: Tensor, q_offset: int) -> Tensor:
    """Attention of queries `q` over the cached positions and the new `k`, `v`."""
    if s.cache is not None:
        k, v = s.cache.extend(i, k, v)
    return blocks.attend(q, k, v, s.cfg.causal, q_offset)


def _heads_to_rows(x: Tensor) -> Tensor:
    """`(h, t, d)` as `(t, h * d)`: rows first, so row tiles can travel the ring."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2])


def _rows_to_heads(x: Tensor, d: int) -> Tensor:
    """Inverse of `_heads_to_rows`: `(t, h * d)` as `(h, t, d)`."""
    return x.view(x.shape[0], x.shape[1] // d, d).transpose(0, 1)


def _galaxy_layer(s: _Step, i: int, x: Tensor, tag: str) -> Tensor:
    """One layer in HMP: TP blocks over all rows, connective blocks on own rows `x`."""
    w, cfg = s.w, s.cfg

    def qkv_rows(a: Tensor) -> Tensor:
        return _heads_to_rows(torch.cat(blocks.qkv(a, w, i, s.wheads, cfg), dim=0))

    gathered = s.gather(f"{tag}/qkv", blocks.attention_input(x, w, i, cfg), qkv_rows)
    nq, nkv = len(s.heads), len(cfg.kv_range(s.heads))
    q, k, v = torch.split(_rows_to_heads(gathered, cfg.head_dim), [nq, nkv, nkv], dim=0)
    q, k = blocks.rotate(q, k, s.offset, cfg)  # every row is here now, from position offset
    context = _attend(s, i, q, k, v, s.offset)
    attn = s.scatter(f"{tag}/o", context, lambda c: blocks.out_partial(c, w, i, s.wheads))
    h, mlp_in = blocks.after_attention(x, attn, w, i, cfg)
    e = s.gather(f"{tag}/up", mlp_in, lambda m: blocks.mlp_up(m, w, i, s.wcols, cfg))
    mlp = s.scatter(f"{tag}/down", e, lambda u: blocks.mlp_down_partial(u, w, i, s.wcols))
    return blocks.after_mlp(h, mlp, w, i, cfg)


def _megatron_layer(s: _Step, i: int, x: Tensor, tag: str) -> Tensor:
    """One layer in TP: own heads and columns over all rows, AllReduce after each block."""
    w, cfg = s.w, s.cfg
    q, k, v = blocks.qkv(blocks.attention_input(x, w, i, cfg), w, i, s.wheads, cfg)
    q, k = blocks.rotate(q, k, s.offset, cfg)
    context = _attend(s, i, q, k, v, s.offset)
    attn = s.reduce(f"{tag}/o", context, lambda c: blocks.out_partial(c, w, i, s.wheads))
    h, mlp_in = blocks.after_attention(x, attn, w, i, cfg)
    e = blocks.mlp_up(mlp_in, w, i, s.wcols, cfg)
    mlp = s.reduce(f"{tag}/down", e, lambda u: blocks.mlp_down_partial(u, w, i, s.wcols))
    return blocks.after_mlp(h, mlp, w, i, cfg)


def _sp_layer(s: _Step, i: int, x: Tensor, tag: str) -> Tensor:
    """One layer in SP: the whole model on own rows; keys and values of all rows gathered."""
    w, cfg = s.w, s.cfg
    q, k, v = blocks.qkv(blocks.attention_input(x, w, i, cfg), w, i, s.wheads, cfg)
    q, k = blocks.rotate(q, k, s.offset + s.start, cfg)  # own rows, before keys travel
    # keys and values travel together: one ring step per tile instead of two
    kv = torch.cat([_heads_to_rows(k), _heads_to_rows(v)], dim=1)
    kv = all_gather(s.ring, f"{tag}/kv", kv, s.counts, timeout_s=s.timeout_s)
    k, v = (_rows_to_heads(y, cfg.head_dim) for y in kv.chunk(2, dim=1))
    context = _attend(s, i, q, k, v, s.offset + s.start)
    h, mlp_in = blocks.after_attention(x, blocks.out_partial(context, w, i, s.wheads), w, i, cfg)
    e = blocks.mlp_up(mlp_in, w, i, s.wcols, cfg)
    return blocks.after_mlp(h, blocks.mlp_down_partial(e, w, i, s.wcols), w, i, cfg)


def generate(
    ring: Ring | None,
    layout: Layout,
    w: Mapping[str, Tensor],
    config: TransformerConfig,
    ids: Tensor,
    new_tokens: int,
    *,
    tag: str = "gen",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sharded: bool = False,
    on_prompt: Callable[[Tensor], None] | None = None,
    sampler: Sampler = GREEDY,
    stop: Collection[int] = (),
    on_token: Callable[[int], None] | None = None,
    first_step: int = 0,
) -> list[int]:
    """Decoding on this device with its KV cache; every device returns the same tokens.

    `sampler` picks each token (greedy by default) from logits that are equal on
    every device, so the devices agree without a message. Generation ends after
    `new_tokens` tokens or at the first token in `stop`, which is left out of
    the result (`sampling.finish_reason` tells the two apart). `on_token`
    receives each token kept as it is chosen (for streaming); `on_prompt`
    receives the prompt's logits (the first step's output), so a caller that
    wants both pays for the prompt once. `first_step` numbers the first token's
    draw (a request re-run from what it generated so far draws on where it
    was). A local layout (no ring) decodes on this device alone.

    Raises:
        ConfigError: For an encoder, `new_tokens < 0`, or a layout that does not fit.
        RoundTimeoutError: If a ring neighbour stays silent for `timeout_s`.

    """
    if new_tokens < 0:
        raise ConfigError(f"new_tokens must be >= 0, got {new_tokens}")
    rank = ring.rank if ring is not None else 0
    cache = new_cache(layout, rank, config)
    stops = frozenset(stop)
    out: list[int] = []
    feed = ids
    with torch.no_grad():
        for step in range(max(new_tokens, 1 if on_prompt else 0)):
            logits = run(
                ring, layout, w, config, feed, cache, tag=tag, timeout_s=timeout_s, sharded=sharded
            )
            if step == 0 and on_prompt is not None:
                on_prompt(logits)
            if step >= new_tokens:
                break
            token = sampler(logits[-1], first_step + step)
            if token in stops:  # every device sees the same token, so all stop here
                break
            out.append(token)
            if on_token is not None:
                on_token(token)
            feed = torch.tensor([token], dtype=ids.dtype, device=ids.device)
    return out
