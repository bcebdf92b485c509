"""What a worker holds: task-pool tensors plus activations kept for backward, in bytes.

The pool's own count is checked against the tensors put into it; the peak of a
whole round is checked in a deterministic lockstep run against bytes computed
from tensor shapes: under 1F1B every stage's saved activations peak at exactly
min(K_p, M) micro-batches, under GPipe at M, and the total (pool included) at
what the same order of tasks must hold, micro-batch by micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from common.job import JobSpec
from common.messages import Activation, Gradient, ReduceChunk
from common.plan import Plan
from common.schedule import Action
from services.worker.pool import TaskPool
from tests.worker.local_pipeline import LocalPipeline

F32, I64 = 4, 8
HIDDEN, CLASSES, PIXELS = 16, 10, 3 * 32 * 32
MLP = {"name": "mlp", "options": {"hidden": HIDDEN, "depth": 3}}  # 4 layers
S, M, N = 4, 6, 4  # stages of one layer each, micro-batches, samples per micro-batch
K = [min(2 * (S - p) - 1, M) for p in range(S)]  # 6, 5, 3, 1: stage 0 is capped at M


def act(round_no=0, mb=0, lo=0, hi=4):
    return Activation(epoch=1, round=round_no, mb=mb, stage=1, lo=lo, hi=hi)


def fresh_pool(span=(0, 4)):
    pool = TaskPool()
    pool.reset(epoch=1, stage=1, span=span)
    pool.begin_round(0)
    return pool


def test_pool_counts_the_storages_it_holds_until_taken():
    pool = fresh_pool()
    x, y = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)
    assert pool.put_part(act(), [x, y], "prev") is None
    assert pool.resident_bytes() == 4 * 8 * F32 + 4 * I64
    # a view costs its whole storage: a slice of a 100-row buffer keeps 100 rows
    big = torch.zeros(100, 8)
    assert pool.put_part(act(mb=1), [big[:4], y.clone()], "prev") is None
    assert pool.resident_bytes() == 4 * 8 * F32 + 4 * I64 + 100 * 8 * F32 + 4 * I64
    assert pool.take(0, "F", 0)[0] is x
    assert pool.resident_bytes() == 100 * 8 * F32 + 4 * I64
    pool.take(0, "F", 1)
    assert pool.resident_bytes() == 0
    assert pool.peak_bytes == 4 * 8 * F32 + 100 * 8 * F32 + 2 * 4 * I64


def test_dropped_parts_cost_nothing_and_finished_rounds_are_let_go():
    pool = fresh_pool(span=(0, 4))
    t = [torch.zeros(4, 8)]
    assert pool.put_part(act(), t, "prev") is None
    held = pool.resident_bytes()
    assert "duplicate" in pool.put_part(act(), [torch.zeros(4, 8)], "prev")
    assert "out-of-range" in pool.put_part(act(mb=1, lo=2, hi=6), [torch.zeros(4, 8)], "prev")
    assert "epoch" in pool.put_part(
        Activation(epoch=0, round=0, mb=2, stage=1, lo=0, hi=4), [torch.zeros(4, 8)], "prev"
    )
    assert pool.resident_bytes() == held == pool.peak_bytes
    # a gradient and a reduce chunk of the next round are held, then round 0's part goes
    assert pool.put_part(Gradient(epoch=1, round=1, mb=0, stage=1, lo=0, hi=4), t, "prev") is None
    chunk = ReduceChunk(epoch=1, round=1, stage=1, step=0, chunk=0)
    assert pool.put_chunk(chunk, torch.zeros(3), "prev") is None
    assert pool.resident_bytes() == 2 * held + 3 * F32
    pool.begin_round(1)
    assert pool.resident_bytes() == held + 3 * F32 == pool.peak_bytes
    pool.take_chunk(1, 0, 0, timeout_s=1)
    pool.take(1, "B", 0)
    assert pool.resident_bytes() == 0


def test_peak_adds_saved_activations_to_the_pool_and_restarts_each_round():
    pool = fresh_pool()
    pool.hold_saved(1000)
    assert pool.put_part(act(), [torch.zeros(4, 8)], "prev") is None
    assert (pool.peak_bytes, pool.peak_saved_bytes) == (1000 + 4 * 8 * F32, 1000)
    pool.take(0, "F", 0)
    pool.hold_saved(500)
    pool.release_saved(1500)
    assert (pool.peak_bytes, pool.peak_saved_bytes) == (1500, 1500)
    with pytest.raises(ValueError, match="releasing 1 saved bytes, only 0 are held"):
        pool.release_saved(1)
    pool.begin_round(1)
    assert (pool.peak_bytes, pool.peak_saved_bytes) == (0, 0)


# --- a whole round in lockstep ---------------------------------------------------


def received(p: int) -> int:
    """Bytes of one micro-batch's activation part arriving at stage p: activation and labels."""
    return N * HIDDEN * F32 + N * I64


def gradient(p: int) -> int:
    """Bytes of the gradient of stage p's output (every stage but the last ends in ReLU)."""
    return N * HIDDEN * F32 if p < S - 1 else 0


def kept(p: int) -> int:
    """Bytes one micro-batch of stage p keeps from its forward until its backward.

    Linear keeps its input (layer 0 reads the flattened image, a view of it),
    ReLU its output, which is also the stage's output; cross-entropy keeps the
    log-probabilities, the int64 labels and one float32 scalar (its total
    weight), and the last stage's output is the loss, another float32 scalar.
    """
    width_in = PIXELS if p == 0 else HIDDEN
    if p < S - 1:
        return N * width_in * F32 + N * HIDDEN * F32
    return N * HIDDEN * F32 + N * CLASSES * F32 + N * I64 + 2 * F32


def replay(order: list[tuple[str, Action]]) -> list[int]:
    """Peak bytes per stage that `order` implies, counted micro-batch by micro-batch.

    A forward takes its activation out of the pool (not on stage 0), keeps its
    bytes and puts an activation into the next stage's pool; a backward
    takes its gradient (not on the last stage), frees its kept bytes and puts
    a gradient into the previous stage's pool.
    """
    pool, saved, peak = [0] * S, [0] * S, [0] * S

    def add(p: int, ledger: list[int], nbytes: int) -> None:
        ledger[p] += nbytes
        peak[p] = max(peak[p], pool[p] + saved[p])

    for _, a in order:
        p = a.stage
        if a.kind == "F":
            if p > 0:
                add(p, pool, -received(p))
            if p < S - 1:
                add(p + 1, pool, received(p + 1))
            add(p, saved, kept(p))
        else:
            if p < S - 1:
                add(p, pool, -gradient(p))
            if p > 0:
                add(p - 1, pool, gradient(p - 1))
            add(p, saved, -kept(p))
    assert pool == saved == [0] * S
    return peak


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
def test_lockstep_peak_is_exactly_k_micro_batches(store, policy):
    job = JobSpec.model_validate(
        {
            "job_id": "memory",
            "model": MLP,
            "seed": 7,
            "rounds": 2,
            "optimizer": {"kind": "sgd", "lr": 0.05},
            "policy": policy,
        }
    )
    stages = [{"start": p, "end": p + 1, "devices": [{"device": f"d{p}"}]} for p in range(S)]
    plan = Plan(global_batch=M * N, microbatches=M, stages=stages)
    assert [plan.warmup(p) for p in range(S)] == K
    pipe = LocalPipeline(store, job, plan)
    alive = K if policy == "1f1b" else [M] * S
    for round_no in range(2):  # the second round starts from an empty ledger again
        results, order = pipe.run_lockstep(round_no)
        got = [results[f"d{p}"] for p in range(S)]
        assert [r.peak_saved_bytes for r in got] == [alive[p] * kept(p) for p in range(S)]
        assert [r.peak_bytes for r in got] == replay(order)
        for p in range(S):  # the bound tests/integration/test_memory_bound.py asserts
            ahead = min(alive[p - 1] + 1, M) - alive[p] if p > 0 else 0
            bound = alive[p] * (kept(p) + gradient(p)) + ahead * received(p)
            assert got[p].peak_bytes <= bound, (p, got[p].peak_bytes, bound)
        if policy == "gpipe":  # all M forwards, then every gradient arrives before a backward
            assert [r.peak_bytes for r in got] == [M * (kept(p) + gradient(p)) for p in range(S)]
        for pool in pipe.pools.values():
            assert (pool.resident_bytes(), pool.saved_bytes) == (0, 0)
    assert pipe.out.dropped == []
