import queue
import threading

import pytest
import torch

from common.errors import RoundTimeoutError
from services.worker.allreduce import ring_allreduce
from services.worker.pool import Part, TaskPool


def test_task_ready_when_parts_cover_range_and_concatenates_in_order():
    pool = TaskPool()
    pool.reset(epoch=3, span=(2, 8))
    pool.begin_round(0)
    assert (
        pool.put_part(3, 0, "F", 1, Part(5, 8, [torch.full((3, 2), 2.0), torch.tensor([5, 6, 7])]))
        is None
    )
    assert pool.ready(0, "F") == frozenset()
    assert (
        pool.put_part(3, 0, "F", 1, Part(2, 5, [torch.full((3, 2), 1.0), torch.tensor([2, 3, 4])]))
        is None
    )
    assert pool.ready(0, "F") == {1}
    x, y = pool.take(0, "F", 1)
    assert y.tolist() == [2, 3, 4, 5, 6, 7] and x[:3].eq(1).all() and x[3:].eq(2).all()


def test_stale_duplicate_and_out_of_range_parts_are_dropped():
    pool = TaskPool()
    pool.reset(epoch=2, span=(0, 4))
    pool.begin_round(5)
    t = [torch.zeros(4)]
    assert "epoch" in pool.put_part(1, 5, "F", 0, Part(0, 4, t))
    assert "already finished" in pool.put_part(2, 4, "F", 0, Part(0, 4, t))
    assert pool.put_part(2, 5, "F", 0, Part(0, 4, t)) is None
    assert "duplicate" in pool.put_part(2, 5, "F", 0, Part(0, 4, t))
    assert "out-of-range" in pool.put_part(2, 5, "F", 1, Part(2, 6, t))
    assert pool.put_part(2, 6, "F", 0, Part(0, 4, t)) is None  # next round: kept
    pool.begin_round(6)
    assert pool.ready(6, "F") == {0}
    assert pool.dropped == 4


def test_wait_times_out_with_description():
    pool = TaskPool()
    pool.reset(0, (0, 1))
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
