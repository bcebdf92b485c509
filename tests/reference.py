"""Single-process training computed the plain way: the reference for equivalence.

It reads the same job data (`open_data`) and applies the same learning-rate
schedule (`learning_rate`) as the workers, but builds its own optimizer and
runs the whole model on whole global batches. `assert_matches_reference` and
`assert_losses_match` are the one comparison every equivalence test makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from common.job import JobSpec, OptimizerSpec, learning_rate
from common.job_data import open_data
from common.zoo import build_model

WEIGHT_TOLERANCE = 1e-6
"""Max-abs weight difference allowed: float32 round-off of a reordered sum is ~3e-8, while
one stage ignoring weight decay moves weights by 4e-6 to 1e-5 (`test_mutation`)."""
LOSS_TOLERANCE = 1e-6
"""Max-abs difference allowed per round loss (a loss of ~2.3 has float32 ulps of ~2e-7)."""


def weight_difference(
    weights: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[str, float]:
    """The key whose tensors differ most (max-abs, in float64) and that difference."""
    if weights.keys() != ref.keys():
        missing, extra = sorted(ref.keys() - weights.keys()), sorted(weights.keys() - ref.keys())
        raise AssertionError(f"keys differ from the reference: missing {missing}, extra {extra}")
    worst, key = -1.0, ""
    for k, r in ref.items():
        w = weights[k]
        if w.shape != r.shape:
            raise AssertionError(f"{k}: shape {tuple(w.shape)}, reference {tuple(r.shape)}")
        diff = float((w.double() - r.double()).abs().max()) if r.numel() else 0.0
        if not diff <= worst:  # NaN counts as the worst
            worst, key = diff, k
    return key, worst


def assert_matches_reference(
    weights: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    tol: float = WEIGHT_TOLERANCE,
    what: str = "weights",
) -> None:
    """Fail naming the worst key and its difference when any tensor differs by more than `tol`."""
    key, diff = weight_difference(weights, ref)
    if not diff <= tol:
        raise AssertionError(
            f"{what}: {key} differs from the reference by {diff:.3g} (max-abs), allowed {tol:g}"
        )


def assert_losses_match(
    losses: Sequence[float], ref: Sequence[float], tol: float = LOSS_TOLERANCE
) -> None:
    """Fail naming the first round whose loss differs from the reference's by more than `tol`."""
    if len(losses) != len(ref):
        raise AssertionError(f"{len(losses)} round losses, the reference has {len(ref)}")
    for r, (got, want) in enumerate(zip(losses, ref, strict=True)):
        if not abs(got - want) <= tol:
            raise AssertionError(
                f"loss of round {r}: {got!r}, reference {want!r} "
                f"(difference {abs(got - want):.3g}, allowed {tol:g})"
            )


def reference_job(
    model: dict[str, Any],
    seed: int,
    optimizer: dict[str, Any],
    dataset: dict[str, Any] | None = None,
    rounds: int | None = None,
) -> JobSpec:
    """The job spec the reference and a distributed run share."""
    spec: dict[str, Any] = {"model": model, "seed": seed, "optimizer": optimizer, "rounds": rounds}
    if dataset is not None:
        spec["dataset"] = dataset
    return JobSpec.model_validate(spec)


def reference_optimizer(params: list[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The job's optimizer built here, not by the worker code under test."""
    if spec.kind == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    if spec.kind == "adam":
        return torch.optim.Adam(
            params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)


def reference_train(
    model: dict[str, Any],
    seed: int,
    global_batch: int,
    rounds: int,
    optimizer: dict[str, Any],
    *,
    dataset: dict[str, Any] | None = None,
    total_rounds: int | None = None,
    initial: Mapping[str, torch.Tensor] | None = None,
    init_from: Path | None = None,
    device: torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train `rounds` steps of `global_batch` on one process; returns weights and losses.

    `total_rounds` is the job's length the schedule refers to (default `rounds`),
    so the weights after a prefix of a longer job can be computed too. `initial`:
    weights to start from instead of the seed's (a federated home's local rounds);
    `init_from`: a job's ``init_from`` file, read whole the plain way. `device`:
    where the model computes (a GPU's run comes back as host copies).
    """
    job = reference_job(model, seed, optimizer, dataset, total_rounds or rounds)
    zoo = build_model(job.model, seed)
    net = zoo.full().train()
    if initial is not None:
        net.load_state_dict(initial)
    if init_from is not None:
        net.load_state_dict(load_file(init_from))
    if device is not None:
        net.to(device)
    data = open_data(job, zoo)
    spec = job.optimizer
    opt = reference_optimizer(list(net.parameters()), spec)
    losses = []
    for r in range(rounds):
        x, y = data.train_batch(r * global_batch, global_batch)
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = learning_rate(spec, r, job.total_rounds())
        opt.step()
        losses.append(float(loss.detach()))
    if device is not None:
        return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}, losses
    return net.state_dict(), losses


def reference_train_async(
    model: dict[str, Any],
    seed: int,
    global_batch: int,
    microbatches: int,
    k0: int | Sequence[int],
    rounds: int,
    optimizer: dict[str, Any],
    *,
    aggregate_every: int = 0,
    dataset: dict[str, Any] | None = None,
    drains: Sequence[int] = (0,),
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`mode: async` on one process: delayed gradients in the first stage's 1F1B order.

    The pipeline does not drain between windows: from each drain point (the
    rounds in `drains`: the job's start, a recovery's or a resume's round) to
    the next, the micro-batches of all its windows form one stream, and the
    first stage's textbook 1F1B over that stream (`k0` warm-up forwards, then
    a backward and a forward in turn) fixes the order: a forward runs on the
    weight version current at that moment, its backward gives the gradient of
    that version, and the update goes to the current weights at the learning
    rate of the micro-batch's round; after every `aggregate_every`-th update
    of a window the weights become the mean of the last `k0` updated versions. `k0`
    may differ per window (a re-plan after a recovery changes the pipeline's
    depth); a stream uses its first window's. Returns the final weights and
    each window's loss.
    """
    k0s = [k0] * rounds if isinstance(k0, int) else list(k0)
    job = reference_job(model, seed, optimizer, dataset, rounds)
    zoo = build_model(job.model, seed)
    net = zoo.full().train()
    data = open_data(job, zoo)
    spec = job.optimizer
    opt = reference_optimizer(list(net.parameters()), spec)
    micro = global_batch // microbatches
    losses = [0.0] * rounds
    starts = sorted({0, *(d for d in drains if 0 <= d < rounds)})
    for start, stop in zip(starts, [*starts[1:], rounds], strict=True):
        n = (stop - start) * microbatches
        k = min(k0s[start], microbatches)
        versions = [_params(net)]
        updated: list[int] = []
        pending: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
        order = [("F", g) for g in range(min(k, n))]
        for g in range(n):
            order.append(("B", g))
            if k + g < n:
                order.append(("F", k + g))
        for kind, g in order:
            r, j = start + g // microbatches, g % microbatches
            if kind == "F":
                x, y = data.train_batch(r * global_batch + j * micro, micro)
                params = {name: t.clone().requires_grad_(True) for name, t in versions[-1].items()}
                summed = nn.functional.cross_entropy(
                    torch.func.functional_call(net, params, (x,)), y, reduction="sum"
                )
                losses[r] += float(summed.detach() / global_batch)
                pending[g] = (params, summed / micro)
                continue
            params, loss = pending.pop(g)
            loss.backward()
            for name, p in net.named_parameters():
                p.grad = params[name].grad
            for group in opt.param_groups:
                group["lr"] = learning_rate(spec, r, rounds)
            opt.step()
            versions.append(_params(net))
            updated.append(len(versions) - 1)
            if aggregate_every and (j + 1) % aggregate_every == 0:
                recent = [versions[v] for v in updated[-k:]]
                with torch.no_grad():
                    for name, p in net.named_parameters():
                        p.copy_(torch.stack([v[name] for v in recent]).mean(dim=0))
                versions.append(_params(net))
    return net.state_dict(), losses


def _params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def reference_eval(
    model: dict[str, Any],
    seed: int,
    weights: dict[str, torch.Tensor],
    count: int,
    *,
    dataset: dict[str, Any] | None = None,
) -> tuple[float, int, int]:
    """Summed cross-entropy, correct predictions and samples over held-out samples.

    Evaluates the first `count` held-out samples, each once (never past the
    data's `eval_size`), with the model in eval mode.
    """
    job = reference_job(model, seed, {}, dataset)
    zoo = build_model(job.model, seed)
    net = zoo.full()
    net.load_state_dict(weights)
    net.eval()
    data = open_data(job, zoo)
    n = min(count, data.eval_size)
    x, y = data.eval_batch(0, n)
    with torch.no_grad():
        out = net(x)
        loss = nn.functional.cross_entropy(out, y, reduction="sum")
    return float(loss), int((out.argmax(dim=1) == y).sum()), n
