"""Checkpoints in Redis: one safetensors blob per layer, committed by a manifest.

Per-layer blobs let each stage leader write only its layers and let a worker
that is (re-)assigned a layer range load only those, so re-planning and
recovery reuse this one format. Optimizer state travels with the weights so a
resumed run continues exactly. No pickle anywhere: safetensors only.

Every replica of a stage reports a digest of the same tensors a checkpoint
holds; the manifest records them, and `check_replicas` refuses a checkpoint
whose replicas disagree (after a ring all-reduce they must agree bit for bit).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from common.errors import CheckpointError
from common.store import Store

__all__ = [
    "OPTIM_PREFIX",
    "check_replicas",
    "checkpoint_digests",
    "commit_checkpoint",
    "latest_round",
    "load_full_state",
    "load_stage",
    "restore_optimizer",
    "save_stage",
    "stage_digest",
]

OPTIM_PREFIX = "__optim__."


def _split_by_layer(
    state: dict[str, torch.Tensor], start: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Stage-module keys `j.rest` -> {start + j: {rest: tensor}}."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        out.setdefault(start + int(head), {})[rest] = value.detach().clone().contiguous()
    return out


def _stage_tensors(
    module: nn.Sequential, optimizer: torch.optim.Optimizer | None, start: int
) -> dict[int, dict[str, torch.Tensor]]:
    """What a checkpoint holds of a stage: weights, buffers and optimizer state by layer."""
    layers = _split_by_layer(module.state_dict(), start)
    for i in range(len(module)):
        layers.setdefault(start + i, {})
    if optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        for param, pstate in optimizer.state.items():
            head, _, rest = names[id(param)].partition(".")
            for sname, value in pstate.items():
                tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                layers[start + int(head)][f"{OPTIM_PREFIX}{rest}.{sname}"] = (
                    tensor.detach().clone().contiguous()
                )
    return layers


def save_stage(
    store: Store,
    job: str,
    round_no: int,
    module: nn.Sequential,
    optimizer: torch.optim.Optimizer | None,
    start: int,
) -> list[int]:
    """Write one blob per layer of `module` (layers start, start+1, ...); returns them."""
    layers = _stage_tensors(module, optimizer, start)
    meta = {"job": job, "round": str(round_no)}
    for layer, tensors in layers.items():
        store.put_blob(st_save(tensors, metadata=meta), "ckpt", job, round_no, "layer", layer)
    return sorted(layers)


def stage_digest(module: nn.Sequential, optimizer: torch.optim.Optimizer | None) -> str:
    """SHA-256 of everything a checkpoint of this stage holds, bit for bit.

    Replicas of a stage hold identical state after the all-reduce, so equal
    digests are the cheap proof that every replica, not only the leader, is right.
    """
    h = hashlib.sha256()
    for layer, tensors in sorted(_stage_tensors(module, optimizer, 0).items()):
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{layer}.{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_replicas(round_no: int, digests: Sequence[Mapping[str, str]]) -> None:
    """Refuse checkpoint `round_no` when the replicas of a stage hold different state.

    Args:
        round_no: The checkpoint's round, for the error.
        digests: Per stage, each device's `stage_digest`.

    Raises:
        CheckpointError: Naming the first stage whose devices disagree, and who holds what.

    """
    for p, by_device in enumerate(digests):
        if len(set(by_device.values())) > 1:
            groups: dict[str, list[str]] = {}
            for device, digest in sorted(by_device.items()):
                groups.setdefault(digest, []).append(device)
            held = "; ".join(f"{', '.join(ds)} hold {d[:12]}" for d, ds in groups.items())
            raise CheckpointError(
                f"checkpoint round {round_no}: the replicas of stage {p} diverged, "
                f"expected one state, got {len(groups)} ({held})"
            )


def _layer(store: Store, job: str, round_no: int, layer: int) -> dict[str, torch.Tensor]:
    blob = store.get_blob("ckpt", job, round_no, "layer", layer)
    if blob is None:
        raise CheckpointError(f"checkpoint round {round_no} of job {job} has no layer {layer}")
    return st_load(blob)


def load_stage(
    store: Store, job: str, round_no: int, start: int, end: int
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Weights of layers [start, end) keyed for a stage module, and optimizer state by param."""
    weights: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for layer in range(start, end):
        for key, value in _layer(store, job, round_no, layer).items():
            if key.startswith(OPTIM_PREFIX):
                pname, _, sname = key[len(OPTIM_PREFIX) :].rpartition(".")
                optim.setdefault(f"{layer - start}.{pname}", {})[sname] = value
            else:
                weights[f"{layer - start}.{key}"] = value
    return weights, optim


def restore_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Put saved per-parameter optimizer state back into `optimizer`."""
    params = dict(module.named_parameters())
    for pname, pstate in optim.items():
        if pname not in params:
            raise CheckpointError(f"optimizer state for unknown parameter {pname}")
        optimizer.state[params[pname]] = dict(pstate)


def commit_checkpoint(
    store: Store,
    job: str,
    round_no: int,
    num_layers: int,
    digests: Sequence[Mapping[str, str]] | None = None,
) -> None:
    """Publish checkpoint `round_no` once every layer is written.

    `digests` (per stage, each device's `stage_digest`) are recorded in the manifest.
    """
    missing = [
        i
        for i in range(num_layers)
        if store.get_json("ckpt", job, round_no, "layer", i, "manifest") is None
    ]
    if missing:
        raise CheckpointError(f"checkpoint round {round_no} of job {job} lacks layers {missing}")
    manifest: dict[str, Any] = {"round": round_no, "layers": num_layers, "time": time.time()}
    if digests is not None:
        manifest["digests"] = [dict(d) for d in digests]
    store.put_json(
        manifest,
        "ckpt",
        job,
        round_no,
        "manifest",
    )
    store.r.set(store.key("ckpt", job, "latest"), round_no)


def latest_round(store: Store, job: str) -> int | None:
    """The newest committed checkpoint round of `job`, if any."""
    raw = store.r.get(store.key("ckpt", job, "latest"))
    return None if raw is None else int(raw)


def checkpoint_digests(store: Store, job: str, round_no: int) -> list[dict[str, str]]:
    """Per stage, each device's digest recorded in committed checkpoint `round_no`."""
    manifest = store.get_json("ckpt", job, round_no, "manifest")
    if manifest is None:
        raise CheckpointError(f"job {job} has no committed checkpoint for round {round_no}")
    return [dict(d) for d in manifest.get("digests", [])]


def load_full_state(store: Store, job: str, round_no: int) -> dict[str, Any]:
    """The whole model's state dict (keys `i.rest`) of a committed checkpoint."""
    manifest = store.get_json("ckpt", job, round_no, "manifest")
    if manifest is None:
        raise CheckpointError(f"job {job} has no committed checkpoint for round {round_no}")
    weights, _ = load_stage(store, job, round_no, 0, int(manifest["layers"]))
    return weights
