"""structlog set-up shared by every service.

Console rendering on a terminal, JSON lines otherwise; job, round, stage and
device are bound by the services so that every line says where it came from.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["bind_global", "configure_logging", "get_logger"]

# Context shared by all threads of the process (contextvars do not cross into
# the receiver and dispatcher threads).
_GLOBAL: dict[str, Any] = {}


def _merge_global(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in _GLOBAL.items():
        event.setdefault(key, value)
    return event


def bind_global(**values: Any) -> None:
    """Bind values (job, round, stage, device) to every later line of every thread."""
    _GLOBAL.update(values)


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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _GLOBAL.clear()
    _GLOBAL.update(bound)


def get_logger(name: str) -> Any:
    """A logger for module `name`."""
    return structlog.get_logger(name)
