import queue
import threading

import pytest
import torch

from common.errors import RoundTimeoutError
from common.messages import Activation, Gradient, ReduceChunk
from services.worker.allreduce import ring_allreduce
from services.worker.pool import TaskPool


def act(epoch=3, round_no=0, mb=1, lo=0, hi=4, stage=1):
    return Activation(epoch=epoch, round=round_no, mb=mb, stage=stage, lo=lo, hi=hi)


def test_task_ready_when_parts_cover_range_and_concatenates_in_order():
    pool = TaskPool()
    pool.reset(epoch=3, stage=1, span=(2, 8))
    pool.begin_round(0)
    x2, y2 = torch.full((3, 2), 2.0), torch.tensor([5, 6, 7])
    assert pool.put_part(act(lo=5, hi=8), [x2, y2], "prev") is None
    assert pool.ready(0, "F") == frozenset()
    assert (
        pool.put_part(act(lo=2, hi=5), [torch.full((3, 2), 1.0), torch.tensor([2, 3, 4])], "prev")
        is None
    )
    assert pool.ready(0, "F") == {1}
    x, y = pool.take(0, "F", 1)
    assert y.tolist() == [2, 3, 4, 5, 6, 7] and x[:3].eq(1).all() and x[3:].eq(2).all()


def test_stale_misaddressed_duplicate_and_out_of_range_parts_are_dropped():
    pool = TaskPool()
    pool.reset(epoch=2, stage=1, span=(0, 4))
    pool.begin_round(5)
    t = [torch.zeros(4)]
    assert "epoch" in pool.put_part(act(epoch=1, round_no=5, mb=0), t, "prev")
    assert "already finished" in pool.put_part(act(epoch=2, round_no=4, mb=0), t, "prev")
    assert "stage 2" in pool.put_part(act(epoch=2, round_no=5, mb=0, stage=2), t, "prev")
    assert pool.put_part(act(epoch=2, round_no=5, mb=0), t, "prev") is None
    assert "duplicate" in pool.put_part(act(epoch=2, round_no=5, mb=0), t, "prev")
    assert "out-of-range" in pool.put_part(act(epoch=2, round_no=5, mb=1, lo=2, hi=6), t, "prev")
    grad = Gradient(epoch=2, round=6, mb=0, stage=1, lo=0, hi=4)
    assert pool.put_part(grad, t, "prev") is None  # next round: kept
    chunk = ReduceChunk(epoch=2, round=5, stage=1, step=0, chunk=1)
    assert pool.put_chunk(chunk, torch.ones(3), "prev") is None
    assert "duplicate reduce chunk" in pool.put_chunk(chunk, torch.ones(3), "prev")
    pool.begin_round(6)
    assert pool.ready(6, "B") == {0}
    assert pool.dropped == 6


def test_wait_times_out_with_description():
    pool = TaskPool()
    pool.reset(0, 0, (0, 1))
    with pytest.raises(RoundTimeoutError, match="gradients of mb 3"):
        pool.wait(lambda: None, 0.05, lambda: "gradients of mb 3")


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("length", [1, 7, 1000])
def test_ring_allreduce_sums_in_threads(n, length):
    inputs = [torch.randn(length, dtype=torch.float64) for _ in range(n)]
    boxes = [queue.Queue() for _ in range(n)]
    out = [None] * n

    def run(rank):
        def send(step, chunk, t):
            boxes[(rank + 1) % n].put((step, chunk, t.clone()))

        pending = {}

        def recv(step, chunk):
            while (step, chunk) not in pending:
                s, c, t = boxes[rank].get(timeout=5)
                pending[(s, c)] = t
            return pending.pop((step, chunk))

        out[rank] = ring_allreduce(inputs[rank].clone(), rank, n, send, recv)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    expected = torch.stack(inputs).sum(0)
    for r in range(n):
        assert torch.allclose(out[r], expected)
        assert torch.equal(out[r], out[0])  # replicas agree bit for bit
