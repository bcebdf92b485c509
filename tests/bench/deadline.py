"""When a long benchmark stops starting new runs: `--deadline HH:MM` (UTC, today)."""

from __future__ import annotations

import datetime
from collections.abc import Callable

__all__ = ["deadline_check"]


def deadline_check(hhmm: str) -> Callable[[], bool]:
    """A check that says whether UTC `hhmm` (today) has passed; never, without one."""
    if not hhmm:
        return lambda: False
    hour, _, minute = hhmm.partition(":")
    now = datetime.datetime.now(datetime.timezone.utc)
    at = now.replace(hour=int(hour), minute=int(minute), second=0, microsecond=0)
    return lambda: datetime.datetime.now(datetime.timezone.utc) >= at
