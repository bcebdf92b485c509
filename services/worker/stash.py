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
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WeightStash"]


class WeightStash:
    """Copies of a module's parameters by version number."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(self, version: int) -> None:
        """Keep the live parameters as `version` (a copy that tracks its own gradients)."""
        self.versions[version] = {
            name: p.detach().clone().requires_grad_(p.requires_grad)
            for name, p in self.module.named_parameters()
        }

    def params(self, version: int) -> dict[str, torch.Tensor]:
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
        for name, _ in self.module.named_parameters():
            t = copy[name]
            grads.append(t.grad)
            t.grad = None
        return grads

    def mean_of(self, versions: list[int]) -> dict[str, torch.Tensor]:
        """The element-wise mean of `versions` (FTPipeHD's aggregation)."""
        copies = [self.params(v) for v in versions]
        return {
            name: torch.stack([c[name].detach() for c in copies]).mean(dim=0) for name in copies[0]
        }

    def keep(self, needed: set[int]) -> None:
        """Drop every version not in `needed`."""
        for v in [v for v in self.versions if v not in needed]:
            del self.versions[v]

    def nbytes(self) -> int:
        """Bytes the stashed copies hold."""
        return sum(t.numel() * t.element_size() for c in self.versions.values() for t in c.values())
