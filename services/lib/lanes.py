"""Duan & Wu's split device: a forward lane beside a backward lane, compute divided by beta.

A device that gives a fraction beta of its compute to forwards and the rest to
backwards runs one forward and one backward at the same time (Duan & Wu,
Sec. III-B). Here the two lanes are two threads of the worker: the forward
lane is a thread of its own, the backward runs on the caller's thread, which
returns to its whole share for everything else (all-reduce, optimizer step).
What the pair shares is safe to share: weights only change at the round's
optimizer step, the backward alone accumulates gradients, and the forward
alone touches the round's loss sums.

How the device is divided depends on its cores (the worker's CPU affinity,
which a testbed device's cpuset sets):

- Two cores or more: the cores are split by beta (`lane_cores`) and each lane
  is pinned to its own (Linux per-thread affinity: `os.sched_setaffinity(0,
  ...)` called from a thread binds that thread only), with one intra-op thread
  per core it owns. PyTorch keeps the intra-op thread count per calling
  thread, and with one thread an operator runs in the calling thread itself,
  so a one-core lane computes exactly on its core. A lane of several threads
  runs its operators on an OpenMP team its thread started; the team's threads
  take the mask their thread had when they were created, so only the lane's
  own thread is certain to stay on its cores there.
- One core: nothing is pinned; each lane gets its share of the intra-op
  threads (`split_threads`), at least one, and the two share the core in time
  as the operating system schedules them, which divides nothing: whether the
  split pays is then for the measurement (`services.lib.split_gain`) to say.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

__all__ = [
    "SplitLanes",
    "bound_to",
    "device_cores",
    "lane_cores",
    "single_thread",
    "split_threads",
]


def split_threads(beta: float, threads: int) -> tuple[int, int]:
    """Intra-op threads (or cores) of the forward and the backward lane: beta of `threads`.

    Each lane gets at least one, so with a single thread the two lanes share
    that core in time, as the operating system schedules them.
    """
    forward = min(max(1, round(beta * threads)), max(1, threads - 1))
    return forward, max(1, threads - forward)


def device_cores() -> frozenset[int] | None:
    """The cores this process may run on (its cpuset), None where the OS does not say."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def lane_cores(beta: float, cores: Collection[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """Disjoint cores of the forward and the backward lane, by beta; None on fewer than two.

    The forward lane takes the lowest-numbered cores, `split_threads(beta, n)[0]` of them.
    """
    ordered = sorted(set(cores))
    if len(ordered) < 2:
        return None
    forward, _ = split_threads(beta, len(ordered))
    return frozenset(ordered[:forward]), frozenset(ordered[forward:])


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads on this thread, then restore the count.

    Setting the count is not free (the intra-op pools are resized), so a
    count that is already right is left alone.
    """
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_thread() -> contextlib.AbstractContextManager[None]:
    """Run the block with one intra-op thread on this thread (operators in the thread itself)."""
    return _threads(1)


@contextmanager
def bound_to(cores: Collection[int] | None) -> Iterator[None]:
    """Run the block with this thread bound to `cores` (None: as it is), then restore.

    Threads started inside the block inherit the mask and keep it.
    """
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class SplitLanes:
    """Runs a forward and a backward side by side; one instance per stage runner.

    `cores` defaults to this process's affinity; `pin=False` keeps the lanes
    unpinned whatever the cores (the measurement of the time-sliced split).
    """

    def __init__(
        self,
        beta: float,
        threads: int | None = None,
        cores: Collection[int] | None = None,
        pin: bool = True,
    ) -> None:
        self.beta = beta
        have = device_cores() if cores is None else frozenset(cores)
        self.cores = lane_cores(beta, have) if pin and have is not None else None
        """(forward cores, backward cores) where the lanes are pinned, else None."""
        if self.cores is not None:
            self.forward_threads, self.backward_threads = (len(c) for c in self.cores)
        else:
            total = threads if threads is not None else torch.get_num_threads()
            self.forward_threads, self.backward_threads = split_threads(beta, total)
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="forward-lane", initializer=self._start_lane
        )
        self.lane_ident: int | None = None
        """The forward lane thread's ident, once it ran something (tests check the overlap)."""

    @property
    def pinned(self) -> bool:
        """Whether each lane runs on cores of its own."""
        return self.cores is not None

    def _start_lane(self) -> None:
        # PyTorch sets a thread's count from the process-wide one at its first query
        # or parallel operation: have that happen first, or it overwrites ours later
        torch.get_num_threads()
        torch.set_num_threads(self.forward_threads)
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores[0])  # this thread only, for its whole life
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
                with (
                    bound_to(None if self.cores is None else self.cores[1]),
                    _threads(self.backward_threads),
                ):
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
