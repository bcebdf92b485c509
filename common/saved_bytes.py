"""Bytes autograd keeps between a forward and its backward.

The profiler uses it to size a layer's memory per sample; the worker uses it to
report what each micro-batch actually holds until its backward runs. One
counter, so the memory a plan predicts and the memory a worker reports are
counted the same way.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SavedBytes", "weight_storages"]


def weight_storages(module: nn.Module) -> frozenset[int]:
    """Storages of `module`'s weights and buffers, which `SavedBytes` does not count.

    Computed once per module, not per forward: the storages stay put while it trains.
    """
    return frozenset(
        t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
    )


class SavedBytes:
    """Sums the bytes of tensors saved for backward, once per storage, weights excluded.

    Use `pack`/`unpack` as `torch.autograd.graph.saved_tensors_hooks`; `pack`
    may also be called on other tensors the caller keeps (a stage's input and
    output). Weights and buffers are saved too but live as long as the model
    does, so their storages are skipped; a view counts its whole storage.
    """

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t`'s storage unless seen or a weight; autograd keeps `t` itself."""
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (e.g. sparse)
            key, size = id(t), t.numel() * t.element_size()
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.total += size
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        """Give autograd back the tensor it saved."""
        return t
