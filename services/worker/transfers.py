"""Moving tensors between the wire (host memory) and the device a stage computes on.

The codec frames a tensor's host bytes without a copy, and the task pool holds
what arrives in host memory; the stage's weights and computation live on its
device. So a tensor leaving a GPU is copied once, into pinned (page-locked)
host memory, whose copy is the fastest the GPU's DMA engine makes, and its
slices go to the codec as they are; one arriving is copied to the device
before it is used. On a CPU both are the tensor itself: no copy is added.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host"]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: itself on a CPU, else one synchronous copy into pinned memory.

    Synchronous, so the bytes are in place before the codec frames them (a
    dispatcher thread sends them later, zero-copy).
    """
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach())
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: itself when it is there already (always so on a CPU)."""
    return t if t.device == device else t.to(device)
