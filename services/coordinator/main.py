"""`asteroid-coordinator`: the central node of a cluster.

With `--job` and `--plan` it runs that job and exits with a named exit code;
without, it serves the registry until SIGTERM/SIGINT.
"""

from __future__ import annotations

import signal
import sys
from enum import IntEnum
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import CliApp

from common.errors import AsteroidError, ConfigError
from common.job import load_job
from common.logging import configure_logging, get_logger
from common.plan import Plan, load_plan
from common.settings import CoordinatorSettings
from services.coordinator.service import Coordinator

__all__ = ["ExitCode", "main"]

log = get_logger(__name__)


class ExitCode(IntEnum):
    """Process exit codes of the services."""

    OK = 0
    CONFIG = 2
    JOB_FAILED = 3
    INTERRUPTED = 130


def _interrupt(signum: int, _: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _plan(coord: Coordinator, source: str, job_id: str) -> Plan:
    """The plan from a file, or (`redis`) the one stored for the job."""
    if source != "redis":
        return load_plan(Path(source))
    data = coord.store.get_json("plan", job_id)
    if data is None:
        raise ConfigError(f"no plan stored in Redis for job {job_id}")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"plan stored for job {job_id} is invalid: {exc}") from exc


def run(settings: CoordinatorSettings) -> ExitCode:
    """Run the coordinator as configured; returns the exit code."""
    if (settings.job is None) != (settings.plan is None):
        log.error("--job and --plan go together")
        return ExitCode.CONFIG
    try:
        job = load_job(settings.job) if settings.job else None
    except ConfigError as exc:
        log.error("invalid input", error=str(exc))
        return ExitCode.CONFIG
    coord = Coordinator(settings)
    log.info("coordinator listening", bind=coord.endpoint)
    try:
        plan = _plan(coord, settings.plan, job.job_id) if job and settings.plan else None
        if job is None or plan is None:
            while True:
                coord.pump(1.0)
        summary = coord.run_job(job, plan, resume=settings.resume)
        log.info("job finished", job=summary.job_id, losses=[round(x, 4) for x in summary.losses])
        return ExitCode.OK
    except ConfigError as exc:
        log.error("invalid job", error=str(exc))
        return ExitCode.CONFIG
    except AsteroidError as exc:
        log.error("job failed", error=str(exc))
        return ExitCode.JOB_FAILED
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    finally:
        if settings.shutdown_workers:
            coord.shutdown_workers("job ended")
        coord.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-coordinator`."""
    settings = CliApp.run(CoordinatorSettings, cli_args=sys.argv[1:] if argv is None else argv)
    configure_logging(settings.log_level, settings.log_format)
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(int(run(settings)))


if __name__ == "__main__":
    main()
