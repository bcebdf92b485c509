"""Ring collectives over in-process rings: results against the sums computed the plain way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError, RoundTimeoutError
from services.worker.galaxy.collectives import (
    all_gather,
    all_reduce,
    even_counts,
    gather_gemm,
    gemm_all_reduce,
    gemm_scatter,
    reduce_scatter,
    row_offsets,
)
from services.worker.galaxy.ring import LocalRing, Ring, local_rings

T = TypeVar("T")

JOIN_S = 30.0
STEP_S = 10.0


def run_on_ring(world: int, body: Callable[[LocalRing], T]) -> list[T]:
    """Run `body` on every device of a fresh ring, one thread each; re-raise the first error."""
    rings = local_rings(world)
    results: list[T | None] = [None] * world
    errors: list[BaseException] = []

    def target(ring: LocalRing) -> None:
        try:
            results[ring.rank] = body(ring)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in rings]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a device thread did not finish within {JOIN_S} s")
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


SPLITS = [[4], [3, 2], [2, 2], [1, 0], [0, 3], [3, 0, 2], [1, 0, 0], [2, 3, 1], [0, 0, 4, 1]]


def _rows(counts: list[int], width: int = 8) -> tuple[Tensor, list[Tensor]]:
    full = torch.randn(sum(counts), width)
    off = row_offsets(counts)
    return full, [full[off[i] : off[i + 1]] for i in range(len(counts))]


def _ring_order_sum(parts: list[Tensor], r: int) -> Tensor:
    """Tile r's sum in the ring's order: start at device r + 1, add each one's part, end at r."""
    world = len(parts)
    acc = parts[(r + 1) % world]
    for k in range(2, world + 1):
        acc = acc + parts[(r + k) % world]
    return acc


def test_local_rings_satisfy_the_protocol() -> None:
    rings = local_rings(3)
    assert all(isinstance(r, Ring) for r in rings)
    assert [(r.rank, r.world) for r in rings] == [(0, 3), (1, 3), (2, 3)]


def test_messages_are_buffered_by_tag_and_copied() -> None:
    a, b = local_rings(2)
    x = torch.ones(2)
    a.send("late", x)
    a.send("early", torch.zeros(1))
    x.add_(5)
    assert torch.equal(b.recv("early", 1.0), torch.zeros(1))
    assert torch.equal(b.recv("late", 1.0), torch.ones(2))


def test_missing_peer_times_out_naming_peer_and_tag() -> None:
    rings = local_rings(3)
    with pytest.raises(RoundTimeoutError, match=r"device 1 expected 'L0/ag/0' from device 0"):
        rings[1].recv("L0/ag/0", 0.2)


def test_collective_with_a_missing_peer_fails_within_its_timeout() -> None:
    rings = local_rings(2)
    with pytest.raises(RoundTimeoutError, match="from device 0"):
        all_gather(rings[1], "x", torch.zeros(1, 2), [1, 1], timeout_s=0.2)


@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_all_gather_concatenates_rows_in_order(counts: list[int]) -> None:
    full, mine = _rows(counts)
    got = run_on_ring(len(counts), lambda r: all_gather(r, "g", mine[r.rank], counts))
    for g in got:
        assert torch.equal(g, full)


@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_reduce_scatter_sums_each_devices_rows(counts: list[int]) -> None:
    world = len(counts)
    parts = [torch.randn(sum(counts), 8) for _ in range(world)]
    total = torch.stack(parts).sum(0)
    off = row_offsets(counts)
    got = run_on_ring(world, lambda r: reduce_scatter(r, "rs", parts[r.rank], counts))
    for i, g in enumerate(got):
        ring_sum = _ring_order_sum([p[off[i] : off[i + 1]] for p in parts], i)
        assert torch.equal(g, ring_sum)
        torch.testing.assert_close(g, total[off[i] : off[i + 1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_all_reduce_gives_every_device_the_sum(counts: list[int]) -> None:
    world = len(counts)
    parts = [torch.randn(sum(counts), 6) for _ in range(world)]
    total = torch.stack(parts).sum(0)
    got = run_on_ring(world, lambda r: all_reduce(r, "ar", parts[r.rank], counts))
    for g in got:
        torch.testing.assert_close(g, total, rtol=0, atol=1e-6)
        assert torch.equal(g, got[0])


@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_tiled_gather_gemm_equals_plain(counts: list[int]) -> None:
    world = len(counts)
    full, mine = _rows(counts, width=16)
    weights = [torch.randn(12, 16) for _ in range(world)]

    def body(overlap: bool) -> Callable[[LocalRing], Tensor]:
        return lambda r: gather_gemm(
            r, "gg", mine[r.rank], counts, lambda x: x @ weights[r.rank].T, overlap=overlap
        )

    tiled = run_on_ring(world, body(True))
    plain = run_on_ring(world, body(False))
    for i in range(world):
        reference = full @ weights[i].T
        torch.testing.assert_close(tiled[i], plain[i], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(plain[i], reference, rtol=1e-6, atol=1e-6)
        assert tiled[i].shape == (sum(counts), 12)


@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_tiled_gemm_scatter_equals_plain(counts: list[int]) -> None:
    world = len(counts)
    xs = [torch.randn(sum(counts), 16) for _ in range(world)]
    weights = [torch.randn(8, 16) for _ in range(world)]
    total = sum(x @ w.T for x, w in zip(xs, weights, strict=True))
    assert isinstance(total, Tensor)
    off = row_offsets(counts)

    def body(overlap: bool) -> Callable[[LocalRing], Tensor]:
        return lambda r: gemm_scatter(
            r, "gs", xs[r.rank], counts, lambda x: x @ weights[r.rank].T, overlap=overlap
        )

    tiled = run_on_ring(world, body(True))
    plain = run_on_ring(world, body(False))
    for i in range(world):
        torch.testing.assert_close(tiled[i], plain[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(tiled[i], total[off[i] : off[i + 1]], rtol=0, atol=1e-5)


def test_tiled_forms_are_bit_identical_when_the_gemm_is_pure_data_movement() -> None:
    counts = [2, 0, 3]
    xs = [torch.randn(5, 4) for _ in range(3)]
    off = row_offsets(counts)

    def both(overlap: bool) -> Callable[[LocalRing], tuple[Tensor, Tensor]]:
        return lambda r: (
            gemm_scatter(r, "s", xs[r.rank], counts, lambda x: 2 * x, overlap=overlap),
            gather_gemm(
                r,
                "g",
                xs[r.rank][off[r.rank] : off[r.rank + 1]],
                counts,
                lambda x: x.flip(1),
                overlap=overlap,
            ),
        )

    for (ts, tg), (ps, pg) in zip(
        run_on_ring(3, both(True)), run_on_ring(3, both(False)), strict=True
    ):
        assert torch.equal(ts, ps)
        assert torch.equal(tg, pg)


@pytest.mark.parametrize("overlap", [True, False])
def test_gemm_all_reduce_even_split_of_one_row(overlap: bool) -> None:
    xs = [torch.randn(1, 16) for _ in range(3)]
    weights = [torch.randn(8, 16) for _ in range(3)]
    total = sum(x @ w.T for x, w in zip(xs, weights, strict=True))
    assert isinstance(total, Tensor)
    got = run_on_ring(
        3,
        lambda r: gemm_all_reduce(
            r, "ar", xs[r.rank], None, lambda x: x @ weights[r.rank].T, overlap=overlap
        ),
    )
    for g in got:
        torch.testing.assert_close(g, total, rtol=0, atol=1e-5)


def test_even_counts_and_bad_counts() -> None:
    assert even_counts(7, 3) == [3, 2, 2]
    assert even_counts(1, 3) == [1, 0, 0]
    rings = local_rings(2)
    with pytest.raises(ConfigError, match="expected 2 non-negative row counts"):
        all_gather(rings[0], "x", torch.zeros(1, 2), [1, 1, 1])
    with pytest.raises(ConfigError, match="must have 2 rows, got shape"):
        all_gather(rings[0], "x", torch.zeros(1, 2), [2, 1])
    with pytest.raises(ConfigError, match="at least 1 device"):
        local_rings(0)
