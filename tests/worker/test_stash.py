"""Weight stashing is exact: a backward's gradients are those of the version its forward used.

PipeDream's `sgd_with_stashing` check, on a stage of the zoo: forwards of two
micro-batches on two versions, the live weights stepped in between (as the
async stage does after every backward), then the backwards; each gradient must
equal, bitwise, a plain forward and backward of a fresh copy of the model
loaded with that version, and must differ from the gradient of the live
weights (so the check cannot pass by accident).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from common.job import ModelSpec
from common.zoo import build_model
from services.worker.stash import WeightStash


def _stage() -> nn.Module:
    return build_model(ModelSpec(name="small_cnn"), 5).stage(0, 4).train()


def _grads_of(module: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor) -> list:
    """A plain forward and backward of a copy of `module` holding `weights`."""
    fresh = copy.deepcopy(module)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(weights[name])
    fresh.zero_grad()
    fresh(x).square().sum().backward()
    return [p.grad for p in fresh.parameters()]


def test_a_backward_uses_the_version_its_forward_stashed_bitwise() -> None:
    torch.manual_seed(0)
    module = _stage()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    stash = WeightStash(module)
    x0, x1 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    stash.snapshot(0)
    v0 = {k: t.detach().clone() for k, t in stash.params(0).items()}
    out0 = functional_call(module, stash.params(0), (x0,))
    for p in module.parameters():  # an update lands between the forward and its backward
        p.grad = torch.randn_like(p)
    opt.step()
    stash.snapshot(1)
    v1 = {k: t.detach().clone() for k, t in stash.params(1).items()}
    out1 = functional_call(module, stash.params(1), (x1,))
    opt.step()  # and another one, on the live weights only
    out0.square().sum().backward()
    got0 = stash.take_grads(0)
    out1.square().sum().backward()
    got1 = stash.take_grads(1)
    for got, weights, x in ((got0, v0, x0), (got1, v1, x1)):
        want = _grads_of(module, weights, x)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        live = _grads_of(module, dict(module.named_parameters()), x)
        assert not all(torch.equal(g, w) for g, w in zip(got, live, strict=True))
    assert all(t.grad is None for t in stash.params(0).values())  # taken, not accumulated


def test_versions_are_kept_dropped_and_averaged() -> None:
    module = nn.Linear(3, 2)
    stash = WeightStash(module)
    for v in range(3):
        with torch.no_grad():
            module.weight.fill_(float(v))
        stash.snapshot(v)
    assert torch.equal(stash.mean_of([0, 1, 2])["weight"], torch.full((2, 3), 1.0))
    assert stash.nbytes() == 3 * (6 + 2) * 4
    stash.keep({2})
    assert sorted(stash.versions) == [2]
    with pytest.raises(KeyError, match=r"weight version 0 is not stashed \(have \[2\]\)"):
        stash.params(0)
