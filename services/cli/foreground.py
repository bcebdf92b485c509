"""Commands that run children in the foreground: one way to stop them and to exit.

SIGINT and SIGTERM both raise KeyboardInterrupt (the command's context
managers then stop every child) and set `STOP`, which loops also check:
Python drops a KeyboardInterrupt raised while a subprocess is being forked,
so a Ctrl-C landing then would otherwise be lost. Errors become the exit-code
table's codes (`services.cli.failure`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import typer
from rich.console import Console

from common.errors import AsteroidError
from common.exit_codes import ExitCode
from services.cli.failure import fail

__all__ = ["STOP", "foreground"]

STOP = threading.Event()
"""Set by SIGINT/SIGTERM for loops that run while children start."""


def _interrupt(signum: int, _: object) -> None:
    STOP.set()
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def foreground(console: Console, stopped: str) -> Iterator[None]:
    """Run the body with the signal handlers; print `stopped` if interrupted."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    except KeyboardInterrupt:
        console.print(stopped)
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except AsteroidError as exc:  # one line on stderr, the exit-code table's code
        raise fail(exc) from exc
