"""`asteroid`: the command line for people.

demo and up run a whole cluster on this machine; train, status, cancel and
export work with a running coordinator and its Redis; plan and profile look
at plans and devices before training. Exit codes: `common.exit_codes.ExitCode`.
"""

from __future__ import annotations

import typer

from services.cli import jobs, keys, local
from services.cli import plan as plan_cmd
from services.cli import testbed as testbed_cmd

__all__ = ["app"]

app = typer.Typer(
    help="Asteroid-Edge: hybrid-pipeline training across edge devices.", no_args_is_help=True
)


@app.callback()
def _root() -> None:
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
app.command()(local.up)
app.command()(jobs.train)
app.command()(plan_cmd.plan)
app.command()(jobs.status)
app.command()(jobs.cancel)
app.command()(jobs.export)
app.add_typer(testbed_cmd.app, name="testbed")
app.add_typer(keys.app, name="keys")
