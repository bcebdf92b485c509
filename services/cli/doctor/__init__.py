"""`asteroid doctor`: is this device ready to join its cluster, and if not, what mends it.

It looks at the device (architecture, cores, memory, accelerator, torch
build, extras), then at what the worker would reach and bind with the same
settings (ASTEROID_* variables, overridden by the flags): the coordinator and
whether the CURVE keys match, Redis and whether it lets this device log in,
the clock offset, the data and link ports. Each problem comes with the command
that fixes it; `--json` gives the same for scripts. Every network wait ends
by `--timeout`, so against a host that is down it still ends in seconds.

Exit codes: 0 healthy, 5 at least one problem (`ExitCode.DEVICE_FAILED`), 2 a bad flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["doctor"]


def doctor(
    coordinator: Annotated[
        str | None,
        typer.Option(help="Coordinator control address (default: ASTEROID_COORDINATOR)."),
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(help="This device's key set (default: ASTEROID_KEYS)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Worker name whose key to use (default: the set's only secret key)."),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Redis URL (default: ASTEROID_REDIS_URL, else the coordinator's)."),
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="Cluster key prefix (default: ASTEROID_CLUSTER).")
    ] = None,
    data_port: Annotated[
        int | None, typer.Option(help="The worker's data port (default: ASTEROID_DATA_PORT).")
    ] = None,
    link_port: Annotated[
        int | None, typer.Option(help="The worker's link port (default: ASTEROID_LINK_PORT).")
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, max=60, help="Seconds each network check may wait.")
    ] = 2.0,
    as_json_: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON, for scripts.")
    ] = False,
) -> None:
    """Check this device: hardware, torch, extras, coordinator, keys, Redis, clock, ports."""
    # what the checks need (ZeroMQ, redis, the device probes) loads when doctor runs
    from common.settings import WorkerSettings
    from services.cli.console import CliConsole
    from services.cli.doctor.checks import run_checks
    from services.cli.doctor.report import as_json, exit_code, render

    given: dict[str, Any] = {
        "coordinator": coordinator,
        "keys": keys,
        "device": device,
        "redis_url": redis_url,
        "cluster": cluster,
        "data_port": data_port,
        "link_port": link_port,
    }
    settings = WorkerSettings(**{k: v for k, v in given.items() if v is not None})
    checks = run_checks(settings, timeout)
    if as_json_:
        typer.echo(json.dumps(as_json(checks), indent=2))
    else:
        render(checks, CliConsole())
    raise typer.Exit(int(exit_code(checks)))
