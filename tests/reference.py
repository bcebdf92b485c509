"""Single-process training computed the plain way: the reference for equivalence.

It reads the same job data (`open_data`) and applies the same learning-rate
schedule (`learning_rate`) as the workers, but builds its own optimizer and
runs the whole model on whole global batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.job import JobSpec, learning_rate
from common.job_data import open_data
from common.zoo import build_model


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


def reference_train(
    model: dict[str, Any],
    seed: int,
    global_batch: int,
    rounds: int,
    optimizer: dict[str, Any],
    *,
    dataset: dict[str, Any] | None = None,
    total_rounds: int | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train `rounds` steps of `global_batch` on one process; returns weights and losses.

    `total_rounds` is the job's length the schedule refers to (default `rounds`),
    so the weights after a prefix of a longer job can be computed too.
    """
    job = reference_job(model, seed, optimizer, dataset, total_rounds or rounds)
    zoo = build_model(job.model, seed)
    net = zoo.full().train()
    data = open_data(job, zoo)
    spec = job.optimizer
    if spec.kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            net.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    elif spec.kind == "adam":
        opt = torch.optim.Adam(
            net.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    else:
        opt = torch.optim.AdamW(
            net.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    losses = []
    for r in range(rounds):
        x, y = data.train_batch(r * global_batch, global_batch)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = learning_rate(spec, r, job.total_rounds())
        opt.step()
        losses.append(float(loss.detach()))
    return net.state_dict(), losses


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
