"""Process exit codes of every command and service, named and documented once."""

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """Why a process ended."""

    OK = 0
    """Success."""
    FAILED = 1
    """An unexpected error (a bug): see the log."""
    CONFIG = 2
    """Invalid input: a job, plan, cluster or setting; or no plan fits the cluster."""
    JOB_FAILED = 3
    """The job started but could not finish (a worker failed or vanished)."""
    REDIS_UNAVAILABLE = 4
    """Redis did not answer, or refused the credentials, when the service started."""
    DEVICE_FAILED = 5
    """`asteroid deploy`: a device was unreachable over ssh or a step on it failed."""
    INTERRUPTED = 130
    """Stopped by SIGINT/SIGTERM."""
