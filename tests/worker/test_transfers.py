"""Host and device transfers: on a CPU they are the tensor itself, never a copy."""

from __future__ import annotations

import torch

from services.worker.transfers import to_device, to_host


def test_a_cpu_tensor_crosses_without_a_copy() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    assert to_host(t) is t
    assert to_device(t, torch.device("cpu")) is t
    view = t[1:]  # a slice a route sends: still the same memory
    assert to_host(view).data_ptr() == t[1:].data_ptr()
