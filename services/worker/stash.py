"""Weight stashing for the asynchronous mode: each in-flight micro-batch keeps its version.

A forward in `mode: async` runs on a stashed copy of the stage's weights
(`torch.func.functional_call`), never on the live parameters: the optimizer
changes those in place after every micro-batch's backward, which autograd
would otherwise refuse (a saved tensor modified in place) or, worse, use. The
backward then differentiates through that same copy, so its gradients are
exactly those of the version the forward used (PipeDream's weight stashing),
and they are handed to the live parameters for the update. Versions are kept
while a micro-batch in flight or still to come may need them, and the last
`keep_last` for FTPipeHD's aggregation; the planner counts them.

A snapshot is taken after every update, so it is on the per-micro-batch path:
it copies into a slot (one tensor per parameter) that a dropped version gave
back, and allocates a new slot only when none is free. The slots are therefore
as many as the most versions ever held at once, which the planner's count
(`common.memory_model.stashed_copies`) bounds. A slot is given back only once
no micro-batch in flight runs on it (the caller keeps those), so no autograd
graph still holds the tensors overwritten.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WeightStash"]

Slot = dict[str, torch.Tensor]


class WeightStash:
    """Copies of a module's parameters by version number, in reusable slots."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        """Parameter names in order, listed once (the parameters never change)."""
        self.live = [p for _, p in module.named_parameters()]
        self.versions: dict[int, Slot] = {}
        self.free: list[Slot] = []
        """Slots of dropped versions, to copy the next snapshots into."""
        self.slots = 0
        """Slots allocated so far: the most versions held at once."""

    def snapshot(self, version: int) -> None:
        """Keep the live parameters as `version` (a copy that tracks its own gradients)."""
        if self.free:
            slot = self.free.pop()
            with torch.no_grad():
                for name, p in zip(self.names, self.live, strict=True):
                    slot[name].copy_(p)
        else:
            slot = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in zip(self.names, self.live, strict=True)
            }
            self.slots += 1
        self.versions[version] = slot

    def params(self, version: int) -> Slot:
        """The parameters of `version`, to run a forward on."""
        try:
            return self.versions[version]
        except KeyError:
            raise KeyError(
                f"weight version {version} is not stashed (have {sorted(self.versions)})"
            ) from None

    def take_grads(self, version: int) -> list[torch.Tensor | None]:
        """The gradients a backward left on `version`'s copy, in parameter order; cleared.

        Several micro-batches may run on one version (the warm-up ones all do):
        each backward's gradients are taken before the next one accumulates.
        """
        copy = self.params(version)
        grads = []
        for name in self.names:
            t = copy[name]
            grads.append(t.grad)
            t.grad = None
        return grads

    def mean_of(self, versions: list[int], live: bool = False) -> Slot:
        """The element-wise mean of `versions` (FTPipeHD's aggregation).

        With `live`, the live parameters stand for the last of them (the version
        the update just made, equal bit for bit), which then need no snapshot.
        """
        copies = [self.params(v) for v in (versions[:-1] if live else versions)]
        if live:
            copies.append(dict(zip(self.names, self.live, strict=True)))
        return {
            name: torch.stack([c[name].detach() for c in copies]).mean(dim=0) for name in self.names
        }

    def aggregate(self, versions: list[int], keep_last: bool) -> None:
        """Set the live parameters to the mean of `versions`, the last being the live ones.

        That last version (the update just made) runs no forward: only a later
        aggregation may average it again, so it is stashed only if `keep_last`.
        """
        if keep_last:
            self.snapshot(versions[-1])
        mean = self.mean_of(versions, live=True)
        with torch.no_grad():
            for name, param in zip(self.names, self.live, strict=True):
                param.copy_(mean[name])

    def keep(self, needed: set[int]) -> None:
        """Drop every version not in `needed`; its slot is reused by a later snapshot."""
        for v in [v for v in self.versions if v not in needed]:
            slot = self.versions.pop(v)
            for t in slot.values():
                t.grad = None
            self.free.append(slot)

    def nbytes(self) -> int:
        """Bytes the stashed copies hold, free slots included (they stay allocated)."""
        slots = [*self.versions.values(), *self.free]
        return sum(t.numel() * t.element_size() for c in slots for t in c.values())
