"""Single-process training computed the plain way: the reference for equivalence."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.data import dataset_for, split_indices
from common.zoo import ModelSpec, build_model


def reference_train(
    model: dict[str, Any], seed: int, global_batch: int, rounds: int, optimizer: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train `rounds` steps of `global_batch` on one process; returns weights and losses."""
    zoo = build_model(ModelSpec.model_validate(model), seed)
    net = zoo.full().train()
    data = dataset_for(zoo, seed)
    kind = optimizer.get("kind", "sgd")
    lr = optimizer.get("lr", 0.05)
    wd = optimizer.get("weight_decay", 0.0)
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            net.parameters(), lr=lr, momentum=optimizer.get("momentum", 0.9), weight_decay=wd
        )
    elif kind == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=wd)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for r in range(rounds):
        x, y = data.batch(split_indices("train", r * global_batch, global_batch))
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return net.state_dict(), losses
