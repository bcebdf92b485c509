"""Ring AllGather, ReduceScatter and AllReduce over uneven row splits, plain or tiled.

Galaxy's planner gives each device a different number of sequence rows (even
none), so every collective takes `counts`, the rows per device in ring order;
device `i` owns rows `[sum(counts[:i]), sum(counts[:i+1]))`.

The tiled forms overlap the GEMM next to the collective with the ring traffic
(§III-D, Figs. 6-7): `gather_gemm` runs the GEMM on each row tile as it passes
through (own tile first), `gemm_scatter` computes the partial sums of one tile
per step and adds the predecessor's running sum to it. Each step sends before it
computes and receives after, so the transfer runs under the GEMM.

Exactness: the plain and tiled forms perform the same additions in the same
order (the running sum of tile `r` starts at device `r + 1`, and each device adds
its own partial to what it received), so they differ only where the GEMM itself
does: a BLAS kernel may round a one-row tile differently from the same row inside
a larger GEMM. Hence equal to ~1e-6 relative, bit-identical for pure data movement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from common.errors import ConfigError, ProtocolError
from services.worker.galaxy.ring import Ring

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "all_gather",
    "all_reduce",
    "even_counts",
    "gather_gemm",
    "gemm_all_reduce",
    "gemm_scatter",
    "placement",
    "reduce_scatter",
    "row_offsets",
]

DEFAULT_TIMEOUT_S = 30.0
"""How long a ring step waits for its predecessor unless told otherwise."""

Gemm = Callable[[Tensor], Tensor]


def row_offsets(counts: Sequence[int]) -> list[int]:
    """Where each device's rows start, plus the total at the end (`len(counts) + 1` values)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def even_counts(total: int, world: int) -> list[int]:
    """Rows per device when nobody planned them: as even as possible, the extra ones first.

    Raises:
        ConfigError: If `total < 0` or `world < 1`.

    """
    if total < 0 or world < 1:
        raise ConfigError(f"need total >= 0 rows over world >= 1 devices, got {total}, {world}")
    base, extra = divmod(total, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def placement(planned: Sequence[int], t: int) -> list[int]:
    """Rows per device for a call of `t` new tokens, given the planned split.

    The plan's own split when it covers `t`; otherwise rows in proportion to it
    (largest remainder), so a one-token decode step puts its single row on the
    device planned for the most rows (the lowest rank among equals).

    Raises:
        ConfigError: If the planned rows are negative or all zero.

    """
    total = sum(planned)
    if total < 1 or any(r < 0 for r in planned):
        raise ConfigError(f"planned rows must be >= 0 and not all 0, got {list(planned)}")
    if total == t:
        return list(planned)
    counts = [r * t // total for r in planned]
    order = sorted(range(len(planned)), key=lambda d: (-(planned[d] * t % total), -planned[d], d))
    for d in order[: t - sum(counts)]:
        counts[d] += 1
    return counts


def _check_counts(ring: Ring, counts: Sequence[int]) -> None:
    if len(counts) != ring.world or any(c < 0 for c in counts):
        raise ConfigError(
            f"expected {ring.world} non-negative row counts (one per device), got {list(counts)}"
        )


def _check_rows(what: str, x: Tensor, rows: int) -> None:
    if x.dim() < 1 or x.shape[0] != rows:
        raise ConfigError(f"{what} must have {rows} rows, got shape {tuple(x.shape)}")


def _recv(ring: Ring, tag: str, rows: int, timeout_s: float) -> Tensor:
    """The predecessor's tensor under `tag`, refused if it has the wrong number of rows."""
    got = ring.recv(tag, timeout_s)
    if got.dim() < 1 or got.shape[0] != rows:
        prev = (ring.rank - 1) % ring.world
        raise ProtocolError(
            f"{tag!r} should have {rows} rows, got shape {tuple(got.shape)}",
            sender=f"device {prev}",
        )
    return got


def _split(x: Tensor, counts: Sequence[int]) -> list[Tensor]:
    off = row_offsets(counts)
    return [x[off[r] : off[r + 1]] for r in range(len(counts))]


def all_gather(
    ring: Ring,
    tag: str,
    mine: Tensor,
    counts: Sequence[int],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """Every device's rows, concatenated in row order, on every device.

    Ring form: at step `s` device `i` forwards tile `(i - s) % D` and receives
    tile `(i - s - 1) % D`; `D - 1` steps.

    Raises:
        ConfigError: If `counts` does not fit the ring or `mine` has not `counts[rank]` rows.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    return gather_gemm(ring, tag, mine, counts, lambda t: t, overlap=False, timeout_s=timeout_s)


def gather_gemm(
    ring: Ring,
    tag: str,
    mine: Tensor,
    counts: Sequence[int],
    gemm: Gemm,
    *,
    overlap: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """`gemm` of the gathered rows: AllGather-then-GEMM, tiled when `overlap`.

    `gemm` must act row by row (row j of its output depends on row j of its input
    only) and accept zero-row input. Tiled (Fig. 6): at step `s` device `i` sends
    tile `(i - s) % D` on, runs `gemm` on it meanwhile, then receives the next;
    `D` GEMMs, `D - 1` transfers; outputs concatenated in row order. Plain: the
    full AllGather, then one GEMM.

    Raises:
        ConfigError: If `counts` does not fit the ring or `mine` has not `counts[rank]` rows.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    _check_counts(ring, counts)
    _check_rows(f"device {ring.rank}'s rows for {tag!r}", mine, counts[ring.rank])
    world, rank = ring.world, ring.rank
    tiles: list[Tensor | None] = [None] * world
    outs: list[Tensor | None] = [None] * world
    tiles[rank] = mine
    for s in range(world):
        r = (rank - s) % world
        tile = tiles[r]
        if tile is None:  # unreachable: step s - 1 received it
            raise ProtocolError(f"tile {r} of {tag!r} missing at step {s}")
        if s < world - 1:
            ring.send(f"{tag}/{s}", tile)
        if overlap:
            outs[r] = gemm(tile)
        if s < world - 1:
            nxt = (rank - s - 1) % world
            tiles[nxt] = _recv(ring, f"{tag}/{s}", counts[nxt], timeout_s)
    if overlap:
        return torch.cat([o for o in outs if o is not None], dim=0)
    return gemm(torch.cat([t for t in tiles if t is not None], dim=0))


def reduce_scatter(
    ring: Ring,
    tag: str,
    full: Tensor,
    counts: Sequence[int],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """Own rows of the sum over devices of `full`, each device's partial sums.

    Ring form: at step `s` device `i` adds its part of tile `(i - s - 1) % D` to
    the running sum received from its predecessor and forwards it; after `D - 1`
    steps the tile it holds is its own, `i`.

    Raises:
        ConfigError: If `counts` does not fit the ring or `full` has not `sum(counts)` rows.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    return gemm_scatter(ring, tag, full, counts, lambda t: t, overlap=False, timeout_s=timeout_s)


def gemm_scatter(
    ring: Ring,
    tag: str,
    x: Tensor,
    counts: Sequence[int],
    gemm: Gemm,
    *,
    overlap: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """Own rows of `sum over devices of gemm(x)`: GEMM-then-ReduceScatter.

    `x` holds all rows on every device (each device its own partial input, e.g.
    its heads' attention context). Tiled (Fig. 7): at step `s` device `i` computes
    `gemm` of tile `(i - s - 1) % D`, adds the running sum received from its
    predecessor and sends the result on; the last step yields its own rows.
    Plain: one GEMM, then the ring ReduceScatter with the same additions.

    Raises:
        ConfigError: If `counts` does not fit the ring or `x` has not `sum(counts)` rows.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    _check_counts(ring, counts)
    _check_rows(f"device {ring.rank}'s input for {tag!r}", x, sum(counts))
    world, rank = ring.world, ring.rank
    parts = None if overlap else _split(gemm(x), counts)
    tiles = _split(x, counts)
    acc: Tensor | None = None
    for s in range(world):
        r = (rank - s - 1) % world
        own = gemm(tiles[r]) if parts is None else parts[r]
        if acc is not None:  # the predecessor's running sum first, as the plain form adds
            own = _recv(ring, f"{tag}/{s - 1}", counts[r], timeout_s) + own
        acc = own
        if s < world - 1:
            ring.send(f"{tag}/{s}", acc)
    if acc is None:  # unreachable: world >= 1
        raise ConfigError(f"{tag!r}: a ring of {world} devices ran no step")
    return acc


def all_reduce(
    ring: Ring,
    tag: str,
    full: Tensor,
    counts: Sequence[int] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """The sum over devices of `full` on every device: ReduceScatter, then AllGather.

    `counts` chooses how the rows are split for the two halves (even by default).

    Raises:
        ConfigError: If `counts` does not fit the ring or `full`.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    return gemm_all_reduce(ring, tag, full, counts, lambda t: t, overlap=False, timeout_s=timeout_s)


def gemm_all_reduce(
    ring: Ring,
    tag: str,
    x: Tensor,
    counts: Sequence[int] | None,
    gemm: Gemm,
    *,
    overlap: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tensor:
    """`sum over devices of gemm(x)` on every device, the ReduceScatter half tiled when `overlap`.

    Raises:
        ConfigError: If `counts` does not fit the ring or `x`.
        RoundTimeoutError: If the predecessor does not deliver in time.

    """
    split = list(counts) if counts is not None else even_counts(x.shape[0], ring.world)
    mine = gemm_scatter(ring, f"{tag}/rs", x, split, gemm, overlap=overlap, timeout_s=timeout_s)
    return all_gather(ring, f"{tag}/ag", mine, split, timeout_s=timeout_s)
