"""How an `asteroid` command fails: one line on stderr and the exit code of the table.

Every command ends an error the same way (`fail`): "error: ..." on stderr, one
line whatever the terminal's width (a script reads stdout, a person sees the
line), credentials hidden, and the code `common.exit_codes.exit_code_of` gives
the error, so Redis and a coordinator that do not answer are UNREACHABLE (4) in
every command, and input that is wrong is CONFIG (2).
"""

from __future__ import annotations

import typer

from common.exit_codes import ExitCode, exit_code_of
from services.cli.console import CliConsole, shown

__all__ = ["err_console", "fail"]

err_console = CliConsole(stderr=True, soft_wrap=True)
"""The CLI's stderr, never wrapped: an error stays one line in a log or a pipe."""


def fail(exc: BaseException, code: ExitCode | None = None) -> typer.Exit:
    """Print `exc` on one line of stderr; the exit to raise, with `code` or the table's.

    A peer's text (a coordinator's refusal) is quoted inert by `shown`.
    """
    err_console.print(f"[red]error:[/red] {shown(exc)}")
    return typer.Exit(int(exit_code_of(exc) if code is None else code))
