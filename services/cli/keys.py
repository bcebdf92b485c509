"""`asteroid keys`: the cluster's CURVE key set.

`asteroid keys init DIR --worker NAME ...` makes the coordinator's pair and one
pair per named worker, service and operator, in role folders (layout and which
device gets which file: `common.curve`). Running it again adds names and keeps
every existing pair, so devices already set up keep working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from common.errors import ConfigError
from common.exit_codes import ExitCode

__all__ = ["app", "init"]

app = typer.Typer(help="CURVE keys of the cluster.", no_args_is_help=True)


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="Directory of the key set.")],
    worker: Annotated[
        list[str] | None, typer.Option(help="A worker device's name (repeatable).")
    ] = None,
    service: Annotated[
        list[str] | None, typer.Option(help="A service's name, e.g. planner (repeatable).")
    ] = None,
    operator: Annotated[
        list[str] | None, typer.Option(help="A person using the CLI (repeatable).")
    ] = None,
) -> None:
    """Create the coordinator's key pair and a pair per named worker, service, operator.

    Give each device the public files (*.key) of the whole set and its own
    secret file only; delete a NAME.key on the coordinator and workers to
    revoke that key.
    """
    from common.curve import FOLDERS, create_key_set  # ZeroMQ: not at every `asteroid` start

    try:
        made = create_key_set(directory, worker or (), service or (), operator or ())
    except (ConfigError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.CONFIG) from exc
    for path in made:
        typer.echo(f"created {path}")
    folders = ", ".join(f"{directory / f}" for f in FOLDERS.values())
    typer.echo(f"key set in {folders} ({len(made)} new secret keys)")
