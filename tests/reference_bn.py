"""Single-process reference for batch-norm models under a plan's sample split.

Batch-norm makes a round depend on how samples are grouped: each device of a
stage normalises its own slice of every micro-batch with that slice's
statistics and updates its own copy of the running statistics, slice after
slice. At round end the group sums gradients and averages float buffers
weighted by each device's share of samples; integer buffers
(`num_batches_tracked`) stay per device and must agree. This module computes
exactly that the plain way: one process, one copy of each stage per device,
activations gathered by sample range between stages, one optimizer step.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from common.job import learning_rate
from common.job_data import open_data
from common.plan import Plan
from common.zoo import build_model
from tests.reference import reference_job, reference_optimizer

__all__ = ["reference_train_sliced"]

Span = tuple[int, int]


def _slices(plan: Plan, stage: int, per_device: bool) -> list[Span]:
    """The sample ranges stage `stage` normalises separately, in sample order."""
    if not per_device:
        return [(0, plan.micro_size)]
    return sorted(plan.ranges(stage).values())


def _sync_params(src: nn.Module, dst: nn.Module) -> None:
    """Give a device's copy the stage's current weights, keeping its own buffers."""
    with torch.no_grad():
        for a, b in zip(src.parameters(), dst.parameters(), strict=True):
            b.copy_(a)
            b.grad = None


def _reduce(stage: nn.Module, copies: Sequence[nn.Module], weights: list[float]) -> None:
    """Sum the copies' gradients into `stage`; average float buffers by sample share."""
    with torch.no_grad():
        for p, *ps in zip(stage.parameters(), *(c.parameters() for c in copies), strict=True):
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in ps]
            p.grad = torch.stack(grads).sum(dim=0)
        named = [dict(c.named_buffers()) for c in copies]
        for name, buf in stage.named_buffers():
            replicas = [n[name] for n in named]
            if buf.is_floating_point():
                buf.copy_(
                    torch.stack([w * b for w, b in zip(weights, replicas, strict=True)]).sum(0)
                )
            else:
                if any(not torch.equal(b, replicas[0]) for b in replicas):
                    raise AssertionError(
                        f"integer buffer {name} differs between device copies: "
                        f"{[b.tolist() for b in replicas]}"
                    )
                buf.copy_(replicas[0])
            for b in replicas:
                b.copy_(buf)


def reference_train_sliced(
    model: dict[str, Any],
    seed: int,
    plan: Plan,
    rounds: int,
    optimizer: dict[str, Any],
    *,
    per_device: bool = True,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train `rounds` rounds of `plan` in one process; returns the state dict and losses.

    With `per_device=False` every stage normalises whole micro-batches instead,
    the semantics of a one-device-per-stage pipeline; tests use it to show
    that the comparison tells the two apart.
    """
    job = reference_job(model, seed, optimizer, rounds=rounds)
    zoo = build_model(job.model, seed)
    data = open_data(job, zoo)
    net = zoo.full().train()
    opt = reference_optimizer(list(net.parameters()), job.optimizer)
    stages = [zoo.stage(s.start, s.end) for s in plan.stages]
    slices = [_slices(plan, p, per_device) for p in range(len(stages))]
    copies = [[copy.deepcopy(st) for _ in sl] for st, sl in zip(stages, slices, strict=True)]
    micro, g = plan.micro_size, plan.global_batch
    losses = []
    for r in range(rounds):
        for st, cs in zip(stages, copies, strict=True):
            for c in cs:
                _sync_params(st, c)
        loss_sum = 0.0
        for mb in range(plan.microbatches):
            h, y = data.train_batch(r * g + mb * micro, micro)
            for sl, cs in zip(slices, copies, strict=True):
                h = torch.cat([c(h[lo:hi]) for c, (lo, hi) in zip(cs, sl, strict=True)])
            loss = nn.functional.cross_entropy(h, y, reduction="sum") / g
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
        for st, cs, sl in zip(stages, copies, slices, strict=True):
            _reduce(st, cs, [(hi - lo) / micro for lo, hi in sl])
        for group in opt.param_groups:
            group["lr"] = learning_rate(job.optimizer, r, job.total_rounds())
        opt.step()
        losses.append(loss_sum)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses
