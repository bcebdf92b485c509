"""What a job spec needs beyond its own fields, checked before anything starts.

The model must build, the data must be there, the planner must exist and
the batch geometry must be complete; each error names the field at fault.
The CLI runs the same checks before submitting, the coordinator again on
submission (its view of the data folder is the one that counts on one
machine; on several, stage 0's devices read it).
"""

from __future__ import annotations

from collections.abc import Collection

from common.errors import ConfigError
from common.job import JobSpec
from common.job_data import train_size
from common.planner_names import PLANNER_NAMES
from common.zoo import build_model

__all__ = ["check_job"]


def check_job(job: JobSpec, allowed_modules: Collection[str] = ()) -> int:
    """The number of rounds `job` runs; ConfigError names the first field at fault.

    `allowed_modules` is the checking service's own ``model_modules`` setting: a
    ``module:factory`` model outside it is refused before anything is imported.
    Building the model is where absurd options meet memory, so whatever the build
    raises (a failed allocation, say) is reported as the model's fault, not the
    service's.
    """
    try:
        build_model(job.model, job.seed, allowed_modules)
    except ConfigError as exc:
        raise ConfigError(f"model: {exc}") from exc
    except (MemoryError, RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"model: {job.model.name!r} cannot be built: {exc!r}") from exc
    if job.planner not in PLANNER_NAMES:
        raise ConfigError(f"planner: {job.planner!r} is not one of {sorted(PLANNER_NAMES)}")
    size = train_size(job)
    try:
        return job.total_rounds(size)
    except ConfigError as exc:
        raise ConfigError(f"epochs: {exc}") from exc
