"""Duan & Wu's split device: a forward lane beside a backward lane, compute divided by beta.

A device that gives a fraction beta of its compute to forwards and the rest to
backwards runs one forward and one backward at the same time (Duan & Wu,
Sec. III-B). Here the two lanes are two threads of the worker, each with its
own share of the worker's intra-op threads (PyTorch keeps the OpenMP thread
count per calling thread): the forward lane is a thread of its own, the
backward runs on the caller's thread, which returns to the whole count for
everything else (all-reduce, optimizer step). What the pair shares is safe to
share: weights only change at the round's optimizer step, the backward alone
accumulates gradients, and the forward alone touches the round's loss sums.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

__all__ = ["SplitLanes", "split_threads"]


def split_threads(beta: float, threads: int) -> tuple[int, int]:
    """Intra-op threads of the forward and the backward lane: beta of `threads` and the rest.

    Each lane gets at least one thread, so with a single thread the two lanes
    share that core in time, as the operating system schedules them.
    """
    forward = min(max(1, round(beta * threads)), max(1, threads - 1))
    return forward, max(1, threads - forward)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads on this thread, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SplitLanes:
    """Runs a forward and a backward side by side; one instance per stage runner."""

    def __init__(self, beta: float, threads: int | None = None) -> None:
        self.beta = beta
        total = threads if threads is not None else torch.get_num_threads()
        self.forward_threads, self.backward_threads = split_threads(beta, total)
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="forward-lane", initializer=self._start_lane
        )
        self.lane_ident: int | None = None
        """The forward lane thread's ident, once it ran something (tests check the overlap)."""

    def _start_lane(self) -> None:
        # PyTorch sets a thread's count from the process-wide one at its first query
        # or parallel operation: have that happen first, or it overwrites ours later
        torch.get_num_threads()
        torch.set_num_threads(self.forward_threads)
        self.lane_ident = threading.get_ident()

    def run(
        self, forward: Callable[[], object] | None, backward: Callable[[], object] | None
    ) -> None:
        """Start `forward` on its lane, run `backward` here, return once both ended.

        Both always end before this returns, also when one raises: no lane is
        left touching the stage's state. The backward's error wins, since the
        forward's is then usually its consequence (an aborted round).
        """
        pending: Future[object] | None = None
        if forward is not None:
            pending = self._pool.submit(forward)
        failed: BaseException | None = None
        if backward is not None:
            try:
                with _threads(self.backward_threads):
                    backward()
            except BaseException as exc:  # raised below, once the forward ended too
                failed = exc
        if pending is not None:
            forward_error = pending.exception()  # waits for the forward
            failed = failed or forward_error
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Stop the forward lane's thread (after the forward it may be running)."""
        self._pool.shutdown(wait=True)
