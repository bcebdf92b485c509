"""Entry point of `asteroid-federation` (see `services.federation.service`).

Exit codes (`common.exit_codes.ExitCode`): 0 stopped by SIGTERM/SIGINT or done (with
--exit-when-done), 2 invalid settings or spec, 4 Redis unreachable at start.
"""

from __future__ import annotations

import sys

import zmq

from common.bootstrap import Stop, run_service
from common.errors import ConfigError, StoreError
from common.exit_codes import ExitCode
from common.fl.spec import load_federation
from common.logging import get_logger
from common.settings import FederationSettings
from services.federation.service import FederationService

__all__ = ["main", "run"]

log = get_logger(__name__)


def run(settings: FederationSettings, stop: Stop) -> ExitCode:
    """Serve the federation in `settings.spec`; a bad setting is one log line, not a trace."""
    try:
        spec = load_federation(settings.spec)
        service = FederationService(settings, spec)
    except ConfigError as exc:
        log.error("federation cannot start", error=str(exc))
        return ExitCode.CONFIG
    except StoreError as exc:
        log.error("federation cannot start", error=str(exc))
        return ExitCode.REDIS_UNAVAILABLE
    except zmq.ZMQError as exc:
        log.error("cannot bind", address=settings.bind, error=str(exc))
        return ExitCode.CONFIG

    stop.on_stop(lambda _: service.stopping.set())
    service.serve()
    return ExitCode.OK


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-federation`."""
    sys.exit(run_service("federation", FederationSettings, run, argv))


if __name__ == "__main__":
    main()
