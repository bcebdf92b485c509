"""structlog set-up shared by every service.

Console rendering on a terminal, JSON lines otherwise; job, round, stage and
device are bound by the services so that every line says where it came from.
Every line passes `mask_secrets` last before rendering, so no service can log a
credential (a Redis password in a URL, an error or a kwargs dict) by mistake.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import MutableMapping
from types import TracebackType
from typing import Any

import structlog

from common.secrets import mask, mask_text

__all__ = ["bind_global", "configure_logging", "get_logger", "mask_secrets"]

# Context shared by all threads of the process (contextvars do not cross into
# the receiver and dispatcher threads).
_GLOBAL: dict[str, Any] = {}


def _merge_global(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in _GLOBAL.items():
        event.setdefault(key, value)
    return event


def mask_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Hide credentials in every value of the line (structlog processor).

    Runs after `format_exc_info`, so a traceback's text is masked too; a value
    under a secret-looking key (``password=...``) is hidden whole.
    """
    for key, value in event.items():
        if key == "exc_info":
            continue  # format_exc_info (earlier in the chain) renders it into masked text
        event[key] = mask({key: value})[key]
    return event


def _masked_excepthook(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """Print an uncaught exception's traceback as Python would, with credentials hidden."""
    sys.stderr.write(mask_text("".join(traceback.format_exception(kind, exc, tb))))
    sys.stderr.flush()


def _masked_thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """Like `_masked_excepthook`, for a thread that died (receiver, dispatcher)."""
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"Exception in thread {name}:\n")
    _masked_excepthook(args.exc_type, args.exc_value, args.exc_traceback)


def bind_global(**values: Any) -> None:
    """Bind values (job, round, stage, device) to every later line of every thread."""
    _GLOBAL.update(values)


# the names a level setting may take (logging.getLevelNamesMapping is Python 3.11 and up)
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def configure_logging(level: str = "info", fmt: str = "auto", **bound: Any) -> None:
    """Configure structlog for this process (stderr) and bind context for all lines."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if use_console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _merge_global,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            mask_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _GLOBAL.clear()
    _GLOBAL.update(bound)
    # a crash's traceback is an error output too: it may quote a URL or redis-py kwargs
    sys.excepthook = _masked_excepthook
    threading.excepthook = _masked_thread_excepthook


def get_logger(name: str) -> Any:
    """A logger for module `name`."""
    return structlog.get_logger(name)
