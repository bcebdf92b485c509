"""What CUDA tests share: their marks, exact GPU arithmetic, and training the plain way on a device.

Every test that needs a GPU is marked `cuda` and skipped where torch sees none
(`make gpu-check` runs them on a machine that has one). TensorFloat-32 is
switched off while they run: cuDNN uses it for float32 convolutions by
default on Ampere and later, and its 10-bit mantissa would swamp every bound
these tests state; deterministic cuDNN algorithms keep two runs of one shape
bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from common.job import learning_rate
from common.job_data import open_data
from common.zoo import build_model
from tests.reference import reference_job, reference_optimizer

CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
"""`pytestmark` of a CUDA test module."""


@contextlib.contextmanager
def exact_cuda() -> Iterator[torch.device]:
    """The first CUDA device, with TF32 off and deterministic cuDNN (restored afterwards)."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield torch.device("cuda", 0)
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved


def reference_train_on(
    device: torch.device,
    model: dict[str, Any],
    seed: int,
    global_batch: int,
    rounds: int,
    optimizer: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`tests.reference.reference_train` with the whole model on `device`; host weights back."""
    job = reference_job(model, seed, optimizer, None, rounds)
    zoo = build_model(job.model, seed)
    net = zoo.full().to(device).train()
    data = open_data(job, zoo)
    spec = job.optimizer
    opt = reference_optimizer(list(net.parameters()), spec)
    losses = []
    for r in range(rounds):
        x, y = data.train_batch(r * global_batch, global_batch)
        loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = learning_rate(spec, r, job.total_rounds())
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}, losses
