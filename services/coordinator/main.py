"""`asteroid-coordinator`: the central node of a cluster.

Without `--job` it serves: workers join, `asteroid train` submits jobs, each
runs through profiling, planning and training, until SIGTERM/SIGINT. With
`--job` it runs that one job (profiled and planned, or with `--plan`) and
exits with a named exit code.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import redis
import yaml
import zmq
from pydantic import ValidationError

from common.bootstrap import Stop, run_service
from common.errors import AsteroidError, ConfigError, StoreError
from common.exit_codes import ExitCode, exit_code_of
from common.job import JobSpec, load_job
from common.logging import get_logger
from common.messages import PlanRequest
from common.plan import Plan, load_plan
from common.profile import ClusterSpec
from common.records.documents import read_plan
from common.secrets import mask_text
from common.settings import CoordinatorSettings
from common.version import VERSION
from services.coordinator.model_probe import start_probe_server
from services.coordinator.service import Coordinator

__all__ = ["bind_problem", "main", "redis_problem", "run"]

log = get_logger(__name__)


def _plan(coord: Coordinator, settings: CoordinatorSettings, job: JobSpec) -> Plan:
    """The plan from a file, from Redis (`redis`), or from the planner (`planner:NAME`)."""
    source = settings.plan or ""
    if source.startswith("planner:"):
        return coord.request_plan(_plan_request(settings, job, source[8:]), settings.plan_timeout_s)
    if source == "redis":
        try:
            stored = read_plan(coord.store, job.job_id)
        except ValidationError as exc:
            raise ConfigError(f"plan stored for job {job.job_id} is invalid: {exc}") from exc
        if stored is None:
            raise ConfigError(f"no plan stored in Redis for job {job.job_id}")
        return stored
    plan = load_plan(Path(source))
    for name in ("global_batch", "microbatches"):
        wanted = getattr(job, name)
        if wanted is not None and wanted != getattr(plan, name):
            raise ConfigError(f"job {name} {wanted} differs from the plan's {getattr(plan, name)}")
    return plan


def _plan_request(settings: CoordinatorSettings, job: JobSpec, planner: str) -> PlanRequest:
    """What to ask the planner: the cluster file, its profiles, the job's batch geometry."""
    if settings.cluster_spec is None:
        raise ConfigError(
            "--plan planner:NAME needs --cluster-spec FILE (devices, memory, bandwidth)"
        )
    if job.global_batch is None or job.microbatches is None:
        raise ConfigError("a planned job needs global_batch and microbatches in its spec")
    try:
        cluster = ClusterSpec.model_validate(yaml.safe_load(settings.cluster_spec.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"cluster spec {settings.cluster_spec} is invalid: {exc}") from exc
    keys = sorted({d.profile for d in cluster.devices})
    return PlanRequest(
        job_id=job.job_id,
        planner=planner,
        cluster=cluster,
        profiles=keys,
        global_batch=job.global_batch,
        microbatches=job.microbatches,
        mode=job.mode,
        aggregate_every=job.aggregate_every,
    )


def bind_problem(address: str, exc: zmq.ZMQError) -> str:
    """Why the control address could not be bound, saying what to do about it.

    A port in use is nearly always a coordinator already running (a second
    `asteroid up`, a service manager's copy): the line says so and how to run
    this one beside it.
    """
    if exc.errno == errno.EADDRINUSE:
        port = address.rpartition(":")[2]
        return (
            f"port {port} is in use ({address}): another coordinator? stop it, or give this "
            "one another --bind (ASTEROID_BIND)"
        )
    return f"cannot bind {address}: {exc.strerror} (check --bind, ASTEROID_BIND)"


def redis_problem(exc: StoreError, where: str) -> str:
    """What went wrong reaching Redis at start, in words that say what to fix.

    Wrong credentials (a refused password, no password where one is required,
    a user without the commands it needs) are told apart from a Redis that
    does not answer, since the fix is elsewhere.
    """
    cause = exc.__cause__
    text = str(cause or exc)
    refused = isinstance(cause, redis.AuthenticationError | redis.exceptions.NoPermissionError)
    if refused or any(word in text for word in ("WRONGPASS", "NOAUTH", "NOPERM")):
        return (
            f"Redis at {where} refused the coordinator's credentials ({mask_text(text)}): "
            "check the user and password in --redis-url (ASTEROID_REDIS_URL) against "
            "Redis's ACL (deploy/redis-acl.conf)"
        )
    return str(exc)


def run(settings: CoordinatorSettings, stop: Stop | None = None) -> ExitCode:
    """Run the coordinator as configured; returns the exit code.

    A `stop` (SIGTERM, Ctrl-C) is taken by the coordinator's loop at its next
    turn: the running job is recorded cancelled and the loop returns. Before the
    loop runs (Redis first reached, a plan asked of the planner) it unwinds the
    start as KeyboardInterrupt.
    """
    stop = stop or Stop("asteroid-coordinator")
    if settings.plan is not None and settings.job is None:
        log.error("--plan needs --job")
        return ExitCode.CONFIG
    if settings.resume and settings.replace:
        log.error("--resume keeps the job's checkpoints and --replace deletes them: give one")
        return ExitCode.CONFIG
    try:
        job = load_job(settings.job) if settings.job else None
    except ConfigError as exc:
        log.error("invalid input", error=str(exc))
        return ExitCode.CONFIG
    try:
        coord = Coordinator(settings)
    except ConfigError as exc:  # e.g. bound beyond loopback without keys
        log.error("coordinator cannot start", error=str(exc))
        return ExitCode.CONFIG
    except zmq.ZMQError as exc:  # one line (run_service's), not a traceback
        raise ConfigError(bind_problem(settings.bind, exc)) from None
    stop.on_stop(coord.stop)
    try:
        coord.store.ping()  # one clear error (its URL's password hidden), not a traceback
    except StoreError as exc:
        log.error("coordinator cannot start", error=redis_problem(exc, coord.store.where))
        coord.close()
        return ExitCode.REDIS_UNAVAILABLE
    try:
        with stop.interrupting():
            coord.raise_fence()
    except AsteroidError as exc:  # Redis stayed away for redis_outage_s: UNREACHABLE
        log.error("coordinator cannot start", error=str(exc))
        coord.close()
        return exit_code_of(exc)
    except KeyboardInterrupt:
        log.info("coordinator stopped")
        coord.close()
        return ExitCode.INTERRUPTED
    log.info("coordinator listening", bind=coord.endpoint, version=VERSION)
    try:
        if job is None:
            start_probe_server()  # its imports overlap the wait for the first submission
            coord.serve()
            return _stopped() if coord.stopping else ExitCode.OK
        with stop.interrupting():
            plan = _plan(coord, settings, job) if settings.plan else None
        summary = coord.run_job(job, plan, resume=settings.resume, replace=settings.replace)
        log.info("job finished", job=summary.job_id, losses=[round(x, 4) for x in summary.losses])
        return ExitCode.OK
    except ConfigError as exc:
        log.error("invalid job", error=str(exc))
        return ExitCode.CONFIG
    except AsteroidError as exc:
        if coord.stopping:
            return _stopped()
        log.error("job failed", error=str(exc))
        return ExitCode.JOB_FAILED
    except KeyboardInterrupt:
        return _stopped()
    finally:
        if settings.shutdown_workers:
            coord.shutdown_workers("coordinator stopped")
        coord.close()


def _stopped() -> ExitCode:
    log.info("coordinator stopped")
    return ExitCode.INTERRUPTED


def _body(settings: CoordinatorSettings, stop: Stop) -> ExitCode:
    """`run` with the service's stop: the coordinator's loop takes it as it comes."""
    return run(settings, stop)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-coordinator`."""
    sys.exit(run_service("coordinator", CoordinatorSettings, _body, argv))


if __name__ == "__main__":
    main()
