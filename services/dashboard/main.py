"""`asteroid-dashboard`: the running cluster as a web page and a Prometheus endpoint.

It reads the cluster's Redis and nothing else, and writes nothing: as many
dashboards as people may run beside a cluster without changing it. The HTTP
server runs as the gateway's does (`services.lib.http_serve`). `asteroid dashboard` runs the
same `serve` in the foreground with the local cluster found for it.

Exit codes: 0 stopped by SIGTERM/SIGINT; 2 invalid settings or a port taken;
130 a second signal (`common.exit_codes.ExitCode`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial

from common.bootstrap import Stop, run_service
from common.curve import is_loopback, load_keys
from common.errors import AsteroidError
from common.exit_codes import ExitCode
from common.extras import require
from common.locate import with_redis
from common.logging import get_logger
from common.store import Store
from services.dashboard.settings import DashboardSettings
from services.lib.http_serve import serve_http

__all__ = ["main", "serve"]

log = get_logger(__name__)

STOP_GRACE_S = 5
"""Longest the HTTP server may take to finish its requests after a stop."""
REDIS_TIMEOUT_S = 5.0
"""Bound on one Redis command: a page waits no longer for an answer."""


class _Stopped(Exception):
    """The stop came while the dashboard waited for Redis."""


def _idle(stop: Stop, seconds: float) -> None:
    """Wait `seconds` between two tries to reach Redis, or end the wait at the stop."""
    if stop.event.wait(seconds):
        raise _Stopped


def serve(
    settings: DashboardSettings,
    stop: Stop,
    on_listening: Callable[[str], None] | None = None,
    redis_patience_s: float | None = None,
    locate_patience_s: float = float("inf"),
) -> ExitCode:
    """Serve the dashboard until `stop`; `on_listening(url)` once it listens.

    Redis must answer first: the service waits for it up to `redis_outage_s`
    (`redis_patience_s` when given; the CLI gives 0, failing at once as every
    command does). Once listening, an outage is shown on the page, not fatal.
    Asked where Redis is, the coordinator has `locate_patience_s` to answer.

    Raises:
        MissingExtraError: The `dashboard` extra is not installed.
        StoreUnavailable: Redis did not answer within the patience.
        ConfigError: The address cannot be listened on (taken, or not this machine's).

    """
    require("uvicorn", "the dashboard", "dashboard")
    require("starlette", "the dashboard", "dashboard")
    require("prometheus_client", "the dashboard", "dashboard")
    from services.dashboard.app import create_app
    from services.dashboard.state import ClusterReader

    host, port = settings.http_host, settings.http_port
    loopback = is_loopback(f"tcp://{host}:{port}")
    if not loopback:
        log.warning("the dashboard listens beyond this machine: whoever reaches it reads it")
    if {"coordinator", "keys"} & settings.model_fields_set:  # else the default URL, as `status`
        keys = load_keys(settings.keys, "operator")
        settings = with_redis(settings, keys, "operator", stop.is_set, locate_patience_s)
    store = Store(settings.redis_url, settings.cluster, REDIS_TIMEOUT_S, REDIS_TIMEOUT_S)
    patience = settings.redis_outage_s if redis_patience_s is None else redis_patience_s
    try:
        if patience > 0:
            store.ride_out(store.probe, "the dashboard started", patience, partial(_idle, stop))
        else:
            store.ping()
    except _Stopped:
        store.close()
        return ExitCode.OK
    except AsteroidError:
        store.close()
        raise
    reader = ClusterReader(store, settings.cluster, settings.stale_s())

    def listening(url: str) -> None:
        log.info("dashboard listening", url=url, redis=store.where, cluster=reader.cluster)
        if on_listening is not None:
            on_listening(url)

    app = create_app(reader, loopback_only=loopback)
    try:
        serve_http(app, host, port, stop, STOP_GRACE_S, "the dashboard", listening)
    finally:
        store.close()
    log.info("dashboard stopped", signal=stop.signal)
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `asteroid-dashboard`."""
    sys.exit(run_service("dashboard", DashboardSettings, serve, argv))


if __name__ == "__main__":
    main()
