"""Ring all-reduce (sum) of one flat tensor inside a stage's device group.

Reduce-scatter then all-gather, n-1 steps each, one chunk per step to the
next device in the ring. Transport is injected (`send`, `recv`) so the same
code runs over ZeroMQ in the worker and over in-process queues in tests.
A sent chunk is never written afterwards: sends are zero-copy and may still
be in flight when the next step runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ring_allreduce"]

Send = Callable[[int, int, torch.Tensor], None]
Recv = Callable[[int, int], torch.Tensor]


def ring_allreduce(
    flat: torch.Tensor, rank: int, size: int, send: Send, recv: Recv
) -> torch.Tensor:
    """Sum `flat` over the ring; returns the result (a new tensor when size > 1).

    `send(step, chunk, tensor)` goes to rank+1; `recv(step, chunk)` comes from rank-1.
    `flat` is consumed: its chunks are reduced in place.
    """
    if size == 1:
        return flat
    chunks = list(torch.tensor_split(flat, size))
    for step in range(size - 1):
        out_i, in_i = (rank - step) % size, (rank - step - 1) % size
        send(step, out_i, chunks[out_i])
        chunks[in_i] += recv(step, in_i)
    # All-gather: forward each received chunk as it is (it is never written), and
    # copy it into the result while the next one is in flight.
    result = torch.empty_like(flat)
    parts = list(torch.tensor_split(result, size))
    own = (rank + 1) % size
    parts[own].copy_(chunks[own])
    forward = chunks[own]
    for step in range(size - 1):
        out_i, in_i = (rank + 1 - step) % size, (rank - step) % size
        send(size - 1 + step, out_i, forward)
        forward = recv(size - 1 + step, in_i)
        parts[in_i].copy_(forward)
    return result
