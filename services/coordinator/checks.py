"""What a job spec needs beyond its own fields, checked before anything starts.

The model must build, the data must be there, the planner must exist and
the batch geometry must be complete; each error names the field at fault.
The CLI runs the same checks before submitting, the coordinator again on
submission (its view of the data folder is the one that counts on one
machine; on several, stage 0's devices read it).
"""

from __future__ import annotations

from collections.abc import Collection

from common.errors import ConfigError, DataPathError
from common.init_weights import WeightsMismatch, init_header
from common.job import JobSpec
from common.job_data import eval_size, train_size
from common.logging import get_logger
from common.planner_names import PLANNER_NAMES
from services.coordinator.checked import CheckedJob
from services.coordinator.model_probe import ProbeLimits, probe_model

__all__ = ["CheckedJob", "check_data", "check_job"]


_LIMITS = ProbeLimits()
log = get_logger(__name__)


def check_job(
    job: JobSpec, allowed_modules: Collection[str] = (), limits: ProbeLimits = _LIMITS
) -> CheckedJob:
    """`job` with what it needs checked and derived; ConfigError names the first field at fault.

    `allowed_modules` is the checking service's own ``model_modules`` setting: a
    ``module:factory`` model outside it is refused before anything is imported.
    The job's own validation already bounded every option and a zoo model's size;
    the model is then built in a child process under `limits` (`probe_model`), so
    what is left (a user factory's appetite, a slow build) is the model's fault and
    never the checking service's memory or time. An ``init_from`` file's header is
    read here and compared with the model's state dict by the same build.
    """
    try:
        shapes = None if job.init_from is None else init_header(job.init_from)
    except DataPathError as exc:  # as for the dataset: the reason stays in this log
        log.warning("refused a job's init_from path", job=job.job_id, reason=exc.detail)
        raise
    try:
        facts = probe_model(job.model, job.seed, allowed_modules, limits, shapes)
    except WeightsMismatch:
        raise
    except ConfigError as exc:
        raise ConfigError(f"model: {exc}") from exc
    return check_data(job, allowed_modules, facts.layers)


def check_data(job: JobSpec, allowed_modules: Collection[str], layers: int) -> CheckedJob:
    """`job` checked but for its model, whose `layers` are known already.

    A resumed job whose spec an earlier coordinator checked and whose
    checkpoint names its layers needs no model build: that build starts a
    process importing torch, which on a loaded board takes seconds while the
    restarted coordinator's socket waits unread. The data is sized again (it
    is cheap, and this machine's view of it is the one that counts).
    """
    if job.planner not in PLANNER_NAMES:
        raise ConfigError(f"planner: {job.planner!r} is not one of {sorted(PLANNER_NAMES)}")
    try:
        size = train_size(job, allowed_modules)
        evals = eval_size(job, allowed_modules)
    except DataPathError as exc:  # the reason stays here: a submitter may be anyone
        log.warning("refused a job's dataset path", job=job.job_id, reason=exc.detail)
        raise
    try:
        rounds = job.total_rounds(size)
    except ConfigError as exc:
        raise ConfigError(f"epochs: {exc}") from exc
    return CheckedJob(job, rounds, size, evals, layers)
