"""Export a job's trained weights from its Redis checkpoints to one file.

Checkpoints are stored per layer for the workers; users want the whole model
in a file that `build_model(spec.model, spec.seed).full()` loads with a strict
`load_state_dict`. The format follows the file's suffix: `.safetensors` (no
pickle, with the job, round and model spec in its metadata) or `.pt` (a plain
state dict that `torch.load(weights_only=True)` reads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from common.checkpoint import committed_rounds, latest_round, load_full_state
from common.errors import CheckpointError, ConfigError, validation_message
from common.job import JobSpec
from common.records.documents import read_jobspec
from common.store import Store
from common.zoo import ZooModel, build_model

__all__ = ["SUFFIXES", "ExportInfo", "committed_rounds", "export_weights", "trained_model"]

SUFFIXES = (".safetensors", ".pt")
"""File suffixes `export_weights` knows, each naming its format."""


@dataclass(frozen=True)
class ExportInfo:
    """What `export_weights` wrote.

    Attributes:
        job: The job whose weights these are.
        round: The checkpoint round exported (rounds completed when it was taken).
        path: The file written.
        tensors: How many tensors the file holds (entries of the state dict).

    """

    job: str
    round: int
    path: Path
    tensors: int


def _job_spec(store: Store, job_id: str) -> JobSpec:
    raw = read_jobspec(store, job_id)
    if raw is None:
        raise ConfigError(f"unknown job {job_id!r}: no job spec is stored under that name")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"stored spec of job {job_id!r}: {validation_message(exc)}") from exc


def _pick_round(store: Store, job_id: str, round_no: int | None) -> int:
    if round_no is None:
        latest = latest_round(store, job_id)
        if latest is None:
            raise ConfigError(f"job {job_id!r} has no committed checkpoint yet")
        return latest
    if store.get_json("ckpt", job_id, round_no, "manifest") is None:
        committed = ", ".join(map(str, committed_rounds(store, job_id))) or "none"
        raise ConfigError(
            f"job {job_id!r} has no committed checkpoint of round {round_no} "
            f"(committed rounds: {committed})"
        )
    return round_no


def _ordered_like(
    expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], where: str
) -> dict[str, torch.Tensor]:
    """`saved` in the key order of `expected`, refusing any difference in keys or shapes."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    for key, ref in expected.items():
        if saved[key].shape != ref.shape:
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(saved[key].shape)}, "
                f"the model wants {tuple(ref.shape)}"
            )
    return {key: saved[key].contiguous() for key in expected}


def trained_model(
    store: Store, job_id: str, round_no: int | None = None, allowed_modules: tuple[str, ...] = ()
) -> tuple[ZooModel, int]:
    """The job's model with the weights of checkpoint `round_no` (default: the newest).

    What serving loads to answer with a model a training job trained. Returns
    the model and the round it holds.

    Raises:
        ConfigError: Unknown job, or no committed checkpoint (of that round).
        CheckpointError: The checkpoint does not match the job's model.

    """
    spec = _job_spec(store, job_id)
    chosen = _pick_round(store, job_id, round_no)
    zoo = build_model(spec.model, spec.seed, allowed_modules)
    full = zoo.full()
    where = f"checkpoint round {chosen} of job {job_id!r}"
    full.load_state_dict(
        _ordered_like(full.state_dict(), load_full_state(store, job_id, chosen), where)
    )
    return zoo, chosen


def export_weights(
    store: Store,
    job_id: str,
    path: Path,
    round_no: int | None = None,
    allowed_modules: tuple[str, ...] = (),
) -> ExportInfo:
    """Write the whole model of checkpoint `round_no` (default: the newest) to `path`.

    The file is written next to `path` and renamed into place, so a reader
    never sees a half-written export. A `module:factory` model is rebuilt only
    from `allowed_modules` (the operator's `model_modules` setting).

    Raises:
        ConfigError: Unknown suffix or job, no committed checkpoint (of that
            round), or `path` cannot be written.
        CheckpointError: The checkpoint does not match the job's model.

    """
    if path.suffix not in SUFFIXES:
        raise ConfigError(
            f"export path {path} must end in {' or '.join(SUFFIXES)}, got {path.suffix!r}"
        )
    spec = _job_spec(store, job_id)
    chosen = _pick_round(store, job_id, round_no)
    expected = build_model(spec.model, spec.seed, allowed_modules).full().state_dict()
    saved = load_full_state(store, job_id, chosen)
    state = _ordered_like(expected, saved, f"checkpoint round {chosen} of job {job_id!r}")
    partial = path.with_name(f".{path.name}.partial")
    try:
        if path.suffix == ".safetensors":
            meta = {"job": job_id, "round": str(chosen), "model": spec.model.model_dump_json()}
            save_file(state, str(partial), metadata=meta)
        else:
            torch.save(state, partial)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"cannot write export {path}: {exc}") from exc
    return ExportInfo(job=job_id, round=chosen, path=path, tensors=len(state))
