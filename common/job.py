"""The training job: what to train, on which data, with which optimizer.

Validated strictly (unknown keys rejected) because a typo in a job file
should stop the job before any device does work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import ConfigError
from common.ids import JobId
from common.zoo import ModelSpec

__all__ = ["JobSpec", "OptimizerSpec", "load_job"]


class OptimizerSpec(BaseModel):
    """Optimizer and its hyper-parameters; applied once per round."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)


class JobSpec(BaseModel):
    """One training job as the coordinator runs it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: JobId = JobId("job")
    model: ModelSpec
    seed: int = 0
    rounds: int = Field(10, ge=1)
    optimizer: OptimizerSpec = OptimizerSpec()
    policy: Literal["1f1b", "gpipe"] = "1f1b"
    global_batch: int | None = Field(
        None, ge=1, description="Samples per round; required when a planner makes the plan."
    )
    microbatches: int | None = Field(None, ge=1, description="Micro-batches per round.")
    checkpoint_every: int = Field(
        0, ge=0, description="Rounds between checkpoints (0: only final)."
    )


def load_job(path: Path) -> JobSpec:
    """Read a job spec from YAML or JSON, with errors that name the file and field."""
    try:
        return JobSpec.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        raise ConfigError(f"job {path} is invalid: {exc}") from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read job {path}: {exc}") from exc
