"""Process exit codes of every command and service, named and documented once.

The one table, enforced by tests/test_exit_codes.py (every `asteroid` command
against an unreachable Redis, a missing coordinator, a bad argument and a bad
file; the code and a one-line message):

| code | name | when |
|---|---|---|
| 0 | OK | success |
| 1 | FAILED | an unexpected error, a bug: the traceback or the log says where |
| 2 | CONFIG | invalid input: an option, a setting, a job, serve, cluster or federation |
|   |        | file, a port in use; or no plan fits the cluster |
| 3 | JOB_FAILED | the job (or request) started but could not finish |
| 4 | UNREACHABLE | the cluster did not answer: Redis or a coordinator (or Redis refused |
|   |             | the credentials) |
| 5 | DEVICE_FAILED | a device is not ready: unreachable over ssh, a deploy step on it |
|   |               | failed, `asteroid doctor` found a problem |
| 130 | INTERRUPTED | stopped by Ctrl-C (SIGINT) or SIGTERM; a followed job cancelled |

Redis and the coordinator share code 4: whichever did not answer, the fix is
the same (start it, or point `--redis-url` / `--coordinator` at it) and the
one-line message names which and where.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode", "exit_code_of"]


class ExitCode(IntEnum):
    """Why a process ended."""

    OK = 0
    """Success."""
    FAILED = 1
    """An unexpected error (a bug): see the log."""
    CONFIG = 2
    """Invalid input: an option, a setting, a file, a port in use; or no plan fits the cluster."""
    JOB_FAILED = 3
    """The job (or request) started but could not finish (a worker failed or vanished)."""
    UNREACHABLE = 4
    """The cluster did not answer: Redis or a coordinator (or Redis refused the credentials)."""
    REDIS_UNAVAILABLE = 4
    """The former name of UNREACHABLE (Redis was its first case)."""
    DEVICE_FAILED = 5
    """A device is not ready: unreachable over ssh, a deploy step failed, doctor found a problem."""
    INTERRUPTED = 130
    """Stopped by SIGINT/SIGTERM."""


def exit_code_of(exc: BaseException) -> ExitCode:
    """The documented exit code for an error that ended a command or a service's body.

    Unreachable (Redis or a coordinator that did not answer) is UNREACHABLE; a
    setting, spec or missing extra (ConfigError) is the person's to fix: CONFIG.
    Any other error raised on purpose means the work could not finish:
    JOB_FAILED. A signal's KeyboardInterrupt is INTERRUPTED; anything else is a
    bug: FAILED.
    """
    from common.errors import AsteroidError, ConfigError, Unreachable  # pydantic: only here

    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, Unreachable):
        return ExitCode.UNREACHABLE
    if isinstance(exc, ConfigError):
        return ExitCode.CONFIG
    if isinstance(exc, AsteroidError):
        return ExitCode.JOB_FAILED
    return ExitCode.FAILED
