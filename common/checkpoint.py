"""Checkpoints in Redis: one safetensors blob per layer, committed by a manifest.

Per-layer blobs let each stage leader write only its layers and let a worker
that is (re-)assigned a layer range load only those, so re-planning and
recovery reuse this one format. Optimizer state travels with the weights so a
resumed run continues exactly. No pickle anywhere: safetensors only.

Every replica of a stage reports a digest of the same tensors a checkpoint
holds; the manifest records them, and `check_replicas` refuses a checkpoint
whose replicas disagree (after a ring all-reduce they must agree bit for bit).

Commit order: layer blobs (each chunks first, its manifest last), then the
checkpoint manifest with each layer's sha256, then `latest`. A crash at any
point leaves `latest` on a checkpoint whose manifest and layers were all
written; what a crash leaves behind of a newer round is removed by
`remove_orphans`. Loading checks every layer against the recorded hashes.

Retention: `prune_checkpoints` keeps the newest few committed checkpoints of a
job (and always the one `latest` names, which recovery and resume load) and
deletes the rest, so that a long job does not fill Redis.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from common.errors import CheckpointError, StoreError
from common.job import check_job_id
from common.logging import get_logger
from common.replica_digests import check_replicas
from common.store import Store

__all__ = [
    "OPTIM_PREFIX",
    "check_replicas",
    "checkpoint_digests",
    "checkpoint_hashes",
    "commit_checkpoint",
    "committed_rounds",
    "latest_round",
    "load_full_state",
    "load_stage",
    "prune_checkpoints",
    "remove_orphans",
    "restore_optimizer",
    "save_stage",
    "stage_blobs",
    "stage_digest",
    "stage_from_blobs",
    "stage_state",
    "stage_tensors",
]

OPTIM_PREFIX = "__optim__."
log = get_logger(__name__)
_ROUND_KEY = re.compile(rb"(\d+):(.*)", re.DOTALL)
_CHUNK_KEY = re.compile(rb"layer:(\d+):chunk:(\d+)")
_LAYER_MANIFEST_KEY = re.compile(rb"layer:(\d+):manifest")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` in host memory: what checkpoints, replicas and digests hold.

    A stage on a GPU keeps its state there; what leaves the stage is a host copy.
    """
    return t.detach().to("cpu", copy=True).contiguous()


def _split_by_layer(
    state: dict[str, torch.Tensor], start: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Stage-module keys `j.rest` -> {start + j: {rest: tensor}}."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        out.setdefault(start + int(head), {})[rest] = _host_copy(value)
    return out


def stage_tensors(
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
                layers[start + int(head)][f"{OPTIM_PREFIX}{rest}.{sname}"] = _host_copy(tensor)
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
    blobs = stage_blobs(module, optimizer, start)
    for layer, blob in blobs.items():
        store.put_blob(blob, "ckpt", job, round_no, "layer", layer)
    return sorted(blobs)


def stage_blobs(
    module: nn.Sequential, optimizer: torch.optim.Optimizer | None, start: int
) -> dict[int, bytes]:
    """One safetensors blob per layer of the stage.

    The unit a checkpoint, a replica and a layer migration all move, so one
    format serves Redis and the data plane.
    """
    return {
        layer: st_save(tensors)
        for layer, tensors in stage_tensors(module, optimizer, start).items()
    }


def stage_digest(module: nn.Sequential, optimizer: torch.optim.Optimizer | None) -> str:
    """SHA-256 of everything a checkpoint of this stage holds, bit for bit.

    Replicas of a stage hold identical state after the all-reduce, so equal
    digests are the cheap proof that every replica, not only the leader, is right.
    """
    h = hashlib.sha256()
    for layer, tensors in sorted(stage_tensors(module, optimizer, 0).items()):
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{layer}.{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _blob(store: Store, job: str, round_no: int, layer: int, expected: str | None = None) -> bytes:
    """Layer `layer`'s blob, checked against its own manifest's hash and `expected`."""
    where = f"checkpoint round {round_no} of job {job}"
    try:
        blob = store.get_blob("ckpt", job, round_no, "layer", layer)
    except CheckpointError:
        raise
    except StoreError as exc:  # missing chunks, or bytes that no longer match their hash
        raise CheckpointError(f"{where}: layer {layer} is damaged: {exc}") from exc
    if blob is None:
        raise CheckpointError(f"{where} has no layer {layer}")
    if expected is not None and (actual := hashlib.sha256(blob).hexdigest()) != expected:
        raise CheckpointError(
            f"{where}: layer {layer} hashes to sha256 {actual}, the checkpoint manifest "
            f"recorded {expected}"
        )
    return blob


def load_stage(
    store: Store,
    job: str,
    round_no: int,
    start: int,
    end: int,
    hashes: Mapping[int, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Weights of layers [start, end) keyed for a stage module, and optimizer state by param.

    Each layer is checked against the sha256 its blob manifest records and, for
    the layers in `hashes` (from the checkpoint manifest, see `checkpoint_hashes`),
    against the hash committed with the checkpoint; a mismatch raises
    CheckpointError naming the layer. A worker passes no `hashes`: its Redis
    user may read only layer keys.
    """
    known = hashes or {}
    blobs = {
        layer: _blob(store, job, round_no, layer, known.get(layer)) for layer in range(start, end)
    }
    return stage_from_blobs(blobs, start, end, f"checkpoint round {round_no} of job {job}")


def stage_from_blobs(
    blobs: Mapping[int, bytes], start: int, end: int, source: str = "the state received"
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Layers [start, end) from per-layer blobs: stage-module weights, optimizer state.

    Raises:
        CheckpointError: A layer is missing or its blob is not valid safetensors
            (it may come from a peer: it is parsed, never executed).

    """
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for layer in range(start, end):
        if layer not in blobs:
            raise CheckpointError(f"{source} has no layer {layer}")
        try:
            layers[layer] = st_load(blobs[layer])
        except Exception as exc:  # safetensors raises its own error types for a bad blob
            raise CheckpointError(
                f"{source}: layer {layer} is not valid safetensors: {exc}"
            ) from exc
    return stage_state(layers, start)


def stage_state(
    layers: Mapping[int, Mapping[str, torch.Tensor]], start: int
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Per-layer tensors (as `stage_tensors` gives them), filed for a stage module.

    The module begins at layer `start`: its weights and buffers by their keys,
    and optimizer state by parameter.
    """
    weights: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for layer, tensors in layers.items():
        for key, value in tensors.items():
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
        param = params[pname]
        # state lives where its parameter does, except a step count, which torch's
        # optimizers keep on the host unless `capturable` (as `load_state_dict` does)
        optimizer.state[param] = {
            name: value.to(param.device) if name != "step" else value
            for name, value in pstate.items()
        }


def commit_checkpoint(
    store: Store,
    job: str,
    round_no: int,
    num_layers: int,
    digests: Sequence[Mapping[str, str]] | None = None,
    version: int | None = None,
) -> None:
    """Publish checkpoint `round_no` once every layer is written.

    `version` names the weight version it holds (updates applied: the round in
    sync mode, every mini-batch's update in async mode), recorded in the manifest.

    `digests` (per stage, each device's `stage_digest`) are recorded in the
    manifest, and so is the sha256 of each layer blob (from the blob manifests
    its writer left), so a load can prove it reads what was committed. The
    manifest is written before `latest` moves: `latest_round` never names a
    checkpoint without one; both go in one MULTI/EXEC, so a Redis that refuses
    the write (full, read-only) leaves neither. Then what earlier crashed uploads
    left is removed (`remove_orphans`); older committed checkpoints stay until
    `prune_checkpoints` drops them.
    """
    manifests = [store.blob_manifest("ckpt", job, round_no, "layer", i) for i in range(num_layers)]
    missing = [i for i, m in enumerate(manifests) if m is None]
    if missing:
        raise CheckpointError(f"checkpoint round {round_no} of job {job} lacks layers {missing}")
    manifest: dict[str, Any] = {"round": round_no, "layers": num_layers, "time": time.time()}
    if version is not None:
        manifest["version"] = version
    hashes = {str(i): m["sha256"] for i, m in enumerate(manifests) if m and "sha256" in m}
    if hashes:
        manifest["sha256"] = hashes
    if digests is not None:
        manifest["digests"] = [dict(d) for d in digests]
    store.put_jsons(
        [(("ckpt", job, round_no, "manifest"), manifest), (("ckpt", job, "latest"), round_no)]
    )
    removed = remove_orphans(store, job)
    if removed:
        log.info("removed orphan checkpoint keys", job=job, round=round_no, keys=removed)


def latest_round(store: Store, job: str) -> int | None:
    """The newest committed checkpoint round of `job`, if any."""
    raw = store.get_json("ckpt", job, "latest")  # a bare integer, which is JSON too
    return None if raw is None else int(raw)


def checkpoint_digests(store: Store, job: str, round_no: int) -> list[dict[str, str]]:
    """Per stage, each device's digest recorded in committed checkpoint `round_no`."""
    manifest = store.get_json("ckpt", job, round_no, "manifest")
    if manifest is None:
        raise CheckpointError(f"job {job} has no committed checkpoint for round {round_no}")
    return [dict(d) for d in manifest.get("digests", [])]


def checkpoint_hashes(store: Store, job: str, round_no: int) -> dict[int, str]:
    """Per layer, the sha256 committed checkpoint `round_no` recorded (empty for older ones)."""
    return {int(k): str(v) for k, v in _manifest(store, job, round_no).get("sha256", {}).items()}


def _manifest(store: Store, job: str, round_no: int) -> dict[str, Any]:
    manifest = store.get_json("ckpt", job, round_no, "manifest")
    if manifest is None:
        raise CheckpointError(f"job {job} has no committed checkpoint for round {round_no}")
    return dict(manifest)


def load_full_state(store: Store, job: str, round_no: int) -> dict[str, Any]:
    """The whole model's state dict (keys `i.rest`) of a committed checkpoint, hash-checked."""
    manifest = _manifest(store, job, round_no)
    hashes = {int(k): str(v) for k, v in manifest.get("sha256", {}).items()}
    weights, _ = load_stage(store, job, round_no, 0, int(manifest["layers"]), hashes)
    return weights


def remove_orphans(store: Store, job: str, *, newer_too: bool = False) -> int:
    """Delete what crashed checkpoint uploads of `job` left; returns how many keys went.

    Removed: every key of a round without a checkpoint manifest that is older
    than the latest committed round (or, with `newer_too`, any uncommitted
    round: only when no upload can be in flight, e.g. while recovering), and in
    committed rounds the chunks beyond their blob's manifest (a blob rewritten
    smaller) or of a layer without one. Committed checkpoints are kept, older
    ones too: a resume may go back to them. The job id is validated before it
    becomes part of a SCAN pattern.
    """
    check_job_id(job, "the checkpoint's job")
    latest = latest_round(store, job)
    rounds = _keys_by_round(store, job)
    doomed: list[bytes] = []
    for round_no, keys in rounds.items():
        if store.get_json("ckpt", job, round_no, "manifest") is not None:
            doomed += _stale_chunks(store, job, round_no, keys)
        elif (latest is not None and round_no < latest) or (
            newer_too and (latest is None or round_no > latest)
        ):
            doomed += keys
    return store.delete(*doomed)


def committed_rounds(store: Store, job: str) -> list[int]:
    """The rounds of `job` with a committed checkpoint (a manifest), oldest first."""
    check_job_id(job, "the checkpoint's job")
    return _committed(store, job, _keys_by_round(store, job))


def prune_checkpoints(store: Store, job: str, keep: int) -> list[int]:
    """Delete every committed checkpoint of `job` but the newest `keep`; the rounds deleted.

    The one `latest` names is kept whatever its age (a heavy recovery may commit
    an older round after newer ones): recovery and resume load that one. A
    checkpoint goes whole, manifest and layers in one DEL, so none is ever left
    committed without its layers. Called once a newer checkpoint is durably
    committed; DEL is what a full Redis still accepts, so pruning frees room.

    Raises:
        ValueError: `keep` is below 1 (the newest checkpoint is never deleted).

    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 checkpoint, got {keep}")
    check_job_id(job, "the checkpoint's job")
    latest = latest_round(store, job)
    rounds = _keys_by_round(store, job)
    committed = _committed(store, job, rounds)
    kept = set(committed[-keep:]) | ({latest} if latest is not None else set())
    doomed = [r for r in committed if r not in kept]
    keys = [key for r in doomed for key in rounds[r]]
    if keys:
        store.delete(*keys)
        log.info("pruned old checkpoints", job=job, rounds=doomed, kept=sorted(kept))
    return doomed


def _committed(store: Store, job: str, rounds: Iterable[int]) -> list[int]:
    """Those of `rounds` with a checkpoint manifest, oldest first."""
    return sorted(r for r in rounds if store.get_json("ckpt", job, r, "manifest") is not None)


def _keys_by_round(store: Store, job: str) -> dict[int, list[bytes]]:
    """The checkpoint keys of `job` grouped by round (`latest` is no round's)."""
    base = store.key("ckpt", job, "").encode()
    out: dict[int, list[bytes]] = {}
    for key in store.keys("ckpt", job, ""):
        if m := _ROUND_KEY.fullmatch(key[len(base) :]):
            out.setdefault(int(m[1]), []).append(key)
    return out


def _stale_chunks(store: Store, job: str, round_no: int, keys: list[bytes]) -> list[bytes]:
    """Chunk keys of committed round `round_no` that no blob manifest counts."""
    base = store.key("ckpt", job, round_no, "").encode()
    rests = [key[len(base) :] for key in keys]
    layers = {int(m[1]) for r in rests if (m := _LAYER_MANIFEST_KEY.fullmatch(r))}
    counts: dict[int, int] = {}
    for layer in layers:
        manifest = store.blob_manifest("ckpt", job, round_no, "layer", layer)
        counts[layer] = 0 if manifest is None else int(manifest["chunks"])
    stale = []
    for key, rest in zip(keys, rests, strict=True):
        if (m := _CHUNK_KEY.fullmatch(rest)) and int(m[2]) >= counts.get(int(m[1]), 0):
            stale.append(key)
    return stale
