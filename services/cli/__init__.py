"""`asteroid`: the command line for people.

demo and up run a whole cluster on this machine; train, status, cancel, drain,
export and federation work with a running service and its Redis; plan and profile look
at plans and devices before training; doctor tells whether this device is ready to
join. Exit codes: `common.exit_codes.ExitCode`.

`main` is the installed `asteroid` command: a bad flag or setting there is
one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from common.cli_args import error_line, is_settings_error
from common.exit_codes import ExitCode
from common.extras import MissingExtraError
from common.version import VERSION
from services.cli import dashboard as dashboard_cmd
from services.cli import deploy as deploy_cmd
from services.cli import doctor as doctor_cmd
from services.cli import federation as federation_cmd
from services.cli import jobs, keys, local, metrics
from services.cli import join as join_cmd
from services.cli import plan as plan_cmd
from services.cli import serve as serve_cmd
from services.cli import testbed as testbed_cmd
from services.cli.example_files import examples

__all__ = ["app", "main"]

app = typer.Typer(
    help="Asteroid-Edge: hybrid-pipeline training across edge devices.", no_args_is_help=True
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"asteroid {VERSION}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Asteroid-Edge command line."""


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def profile(ctx: typer.Context) -> None:
    """Profile a model on this device (the flags of asteroid-profiler; see --help)."""
    from services.profiler.main import main as profiler_main

    profiler_main(list(ctx.args))


app.command()(local.demo)
app.command()(examples)
app.command()(local.up)
app.command()(jobs.train)
app.command()(serve_cmd.serve)
app.command()(serve_cmd.infer)
app.command()(plan_cmd.plan)
app.command()(jobs.status)
app.command()(jobs.cancel)
app.command()(jobs.drain)
app.command()(jobs.export)
app.command()(join_cmd.join)
app.command()(doctor_cmd.doctor)
app.command()(metrics.export_metrics)
app.command()(federation_cmd.federation)
app.command()(dashboard_cmd.dashboard)
app.add_typer(testbed_cmd.app, name="testbed")
app.add_typer(keys.app, name="keys")
app.add_typer(deploy_cmd.app, name="deploy")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid`: the app, with usage and settings errors as one line.

    Click's own report of a bad option is a usage block (a framed panel with
    rich); here it is "asteroid CMD: error: ..." on stderr and exit code 2,
    like every `asteroid-<service>`.
    """
    try:
        code = app(args=argv, prog_name="asteroid", standalone_mode=False)
    except typer.TyperException as exc:  # click's errors, as typer ships it
        ctx = getattr(exc, "ctx", None)
        text = exc.format_message()
        if "\n" in text.strip() or not text.strip():  # the help, for a group with no command
            typer.echo(text, err=True, nl=False)
        else:
            where = ctx.command_path if ctx is not None else "asteroid"
            typer.echo(f"{where}: error: {' '.join(text.split())}", err=True)
        code = exc.exit_code
    except typer.Abort:
        typer.echo("asteroid: aborted", err=True)
        code = int(ExitCode.FAILED)
    except MissingExtraError as exc:  # raised by a command before it could report it itself
        typer.echo(f"asteroid: error: {exc}", err=True)
        code = int(ExitCode.CONFIG)
    except ValidationError as exc:
        if not is_settings_error(exc):
            raise
        typer.echo(f"asteroid: error: {error_line(exc)}", err=True)
        code = int(ExitCode.CONFIG)
    sys.exit(code if isinstance(code, int) else 0)
