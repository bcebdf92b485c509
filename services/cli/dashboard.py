"""`asteroid dashboard`: the running cluster as a web page, in the foreground until Ctrl-C.

The cluster is found as every CLI command finds it (an option, then the
``ASTEROID_*`` variables, then the local cluster `asteroid up` runs), so on
the machine of the quick start it needs no option at all. The page and
Prometheus's ``/metrics`` are `services.dashboard`'s.
"""

from __future__ import annotations

from typing import Annotated

import typer

from common.errors import AsteroidError
from common.exit_codes import ExitCode
from services.cli.console import CliConsole
from services.cli.failure import fail
from services.dashboard import DEFAULT_PORT

__all__ = ["LOCATE_PATIENCE_S", "dashboard"]

LOCATE_PATIENCE_S = 10.0
"""Longest `asteroid dashboard` waits for a coordinator to say where Redis is."""

console = CliConsole()


def dashboard(
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="HTTP port (0: any free one).")
    ] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="Address to listen on; beyond loopback anyone reaching it reads it.")
    ] = "127.0.0.1",
    redis_url: Annotated[
        str | None,
        typer.Option(help="Redis URL (default: ASTEROID_REDIS_URL, else the local cluster's)."),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            help="Cluster key prefix (default: ASTEROID_CLUSTER, else the local cluster's)."
        ),
    ] = None,
    coordinator: Annotated[
        str | None,
        typer.Option(help="Coordinator address, asked where Redis is when no URL is set."),
    ] = None,
) -> None:
    """Show the running cluster in a web page (devices, plan, rounds, events) and /metrics."""
    from common.bootstrap import Stop, stopping_on_signals
    from common.local_cluster import resolve_settings
    from services.dashboard.main import serve
    from services.dashboard.settings import DashboardSettings

    try:
        common = resolve_settings(coordinator, redis_url, cluster)
        fields = {k: getattr(common, k) for k in common.model_fields_set}
        settings = DashboardSettings(**fields, http_host=host, http_port=port)
    except AsteroidError as exc:
        raise fail(exc) from None
    stop = Stop("asteroid dashboard")

    def listening(url: str) -> None:
        # one line, never wrapped: a person copies the address out of it
        line = f"dashboard at {url} (Prometheus: {url}metrics); Ctrl-C stops it"
        console.print(line, soft_wrap=True, highlight=False)

    try:
        with stopping_on_signals(stop):
            # as `status`: Redis answers at once, a coordinator says where it is within 10 s
            code = serve(settings, stop, listening, 0.0, LOCATE_PATIENCE_S)
    except AsteroidError as exc:
        raise fail(exc) from None
    raise typer.Exit(int(code if stop.signal is None else ExitCode.OK))
