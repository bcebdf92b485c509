"""How every `asteroid-<service>` starts and ends: settings, logging, signals, exit code.

Each service's `main` hands `run_service` its name, its settings class and its
body, ``body(settings, stop) -> ExitCode``; the rest is the same for all of them:

- settings from flags over ``ASTEROID_*`` variables (`common.cli_args`): a bad
  flag is one line and exit code 2, ``--help`` and ``--version`` exit 0;
- structlog configured at the settings' level and format, ``service`` bound;
- SIGTERM and SIGINT are one clean stop (`Stop`): the first sets an event, runs
  the body's callbacks and, inside `Stop.interrupting`, raises KeyboardInterrupt
  for a loop that unwinds by it; a second forces the exit, for a stop that hangs;
- an error escaping the body ends the process with its documented exit code
  (`common.exit_codes.ExitCode`): one line on stderr for an error the project
  raises on purpose, a traceback (credentials hidden) for anything else, a bug.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TypeVar

from common.cli_args import parse_settings
from common.errors import AsteroidError
from common.exit_codes import ExitCode, exit_code_of
from common.logging import configure_logging, get_logger
from common.secrets import mask_text
from common.settings import CommonSettings

__all__ = ["SIGNALS", "Stop", "exit_code_of", "run_service", "stopping_on_signals"]

S = TypeVar("S", bound=CommonSettings)

log = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a service: a service manager's (and `stop_all`'s) SIGTERM, a terminal's Ctrl-C."""


class Stop:
    """SIGTERM and SIGINT as one clean stop of a service, a second one as a forced exit.

    The first signal sets `event`, runs every `on_stop` callback (in the main
    thread, as Python runs signal handlers) and, while the main thread is inside
    `interrupting`, raises KeyboardInterrupt there. A second signal means the
    clean stop hangs or the person will not wait: one line on stderr and the
    process ends at once with ExitCode.INTERRUPTED, no cleanup.
    """

    def __init__(self, prog: str) -> None:
        """A stop not yet requested, for the process called `prog` (its forced-exit line)."""
        self.prog = prog
        self.event = threading.Event()
        self.signal: str | None = None
        """The name of the first signal received (None: none yet)."""
        self._callbacks: list[Callable[[str], None]] = []
        self._interrupting = 0

    def is_set(self) -> bool:
        """Whether a stop was requested; a callable for loops that poll (`with_redis`)."""
        return self.event.is_set()

    def on_stop(self, callback: Callable[[str], None]) -> None:
        """Call `callback(signal name)` at the stop; at once if the stop came already.

        So a part built after an early signal (a service still connecting) is
        told as well as one built before it.
        """
        self._callbacks.append(callback)
        if self.signal is not None:
            callback(self.signal)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """Inside: the stop raises KeyboardInterrupt in the main thread (at once if it came).

        For a body whose waits do not watch an event: the exception unwinds them
        through their ``finally`` blocks, which is their cleanup.
        """
        if self.signal is not None:
            raise KeyboardInterrupt(self.signal)
        self._interrupting += 1
        try:
            yield
        finally:
            self._interrupting -= 1

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler (installed by `run_service`)."""
        name = signal.Signals(signum).name
        if self.signal is not None:
            # raw write: the main thread may be inside a write to stderr right now
            os.write(2, f"{self.prog}: {name} again: exiting without cleanup\n".encode())
            os._exit(int(ExitCode.INTERRUPTED))
        self.signal = name
        self.event.set()
        for callback in list(self._callbacks):
            callback(name)
        if self._interrupting:
            raise KeyboardInterrupt(name)


def run_service(
    name: str,
    settings_cls: type[S],
    body: Callable[[S, Stop], ExitCode],
    argv: Sequence[str] | None = None,
) -> int:
    """Start service `name` (the command `asteroid-<name>`), run `body`, return the exit code.

    `argv` defaults to this process's arguments. The signal handlers are
    installed before the body runs (a stop while it connects counts) and the
    previous ones restored after it, so a caller in the same process (a test,
    `asteroid profile`) gets its own back.
    """
    prog = f"asteroid-{name}"
    try:
        settings = parse_settings(settings_cls, argv, prog)
    except SystemExit as done:  # a bad flag (said in one line), --help or --version
        return 0 if done.code is None else done.code if isinstance(done.code, int) else 1
    configure_logging(settings.log_level, settings.log_format, service=name)
    stop = Stop(prog)
    try:
        with stopping_on_signals(stop):
            return int(body(settings, stop))
    except KeyboardInterrupt as exc:  # a signal inside `interrupting` the body did not catch
        log.info("stopped", signal=str(exc) or stop.signal)
        return int(ExitCode.INTERRUPTED)
    except AsteroidError as exc:  # ConfigError and MissingExtraError included
        sys.stderr.write(f"{prog}: error: {' '.join(mask_text(str(exc)).split())}\n")
        return int(exit_code_of(exc))
    except Exception as exc:  # a bug: the traceback is what finds it
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        sys.stderr.write(mask_text("".join(lines)))
        return int(ExitCode.FAILED)


_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


@contextlib.contextmanager
def stopping_on_signals(stop: Stop) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` inside the block; the previous handlers come back after.

    Every service's `run_service`, and a command that runs a service's body in the
    foreground (`asteroid dashboard`).
    """
    previous = _install(stop.handle)
    try:
        yield
    finally:
        _restore(previous)


def _install(handler: Callable[[int, FrameType | None], None]) -> dict[int, _Handler]:
    """Point SIGTERM and SIGINT at `handler`; the handlers they had (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may; a body run from another thread is a test's
    return {sig: signal.signal(sig, handler) for sig in SIGNALS}


def _restore(previous: dict[int, _Handler]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
