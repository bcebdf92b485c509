"""What a shell tells its core about Redis: it went away (`StoreDown`), it is back (`StoreBack`).

A Redis step a job needs (commit a round, record a state) is never retried in
place: the shell holds it, and every command after it, and tells the core.
The core decides what the outage means (`outages`): the job stands still at
the held write, its network events still judged, and fails naming Redis once
the outage outlasts its patience. The message is the one `Store.ride_out`
gives, so a user sees the same failure whichever waited.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import unreachable_for

__all__ = ["StoreBack", "StoreDown", "unreachable"]


@dataclass(frozen=True)
class StoreDown:
    """Redis stopped answering at `since` (monotonic seconds) while the shell was doing `what`.

    `where` is Redis's URL with its password hidden; `error` the client's error, masked.
    """

    what: str
    since: float
    where: str = "Redis"
    error: str = ""


@dataclass(frozen=True)
class StoreBack:
    """The held Redis step went through: Redis answers again."""


def unreachable(down: StoreDown, now: float, patience_s: float) -> str:
    """Why a job fails when Redis stayed away past `patience_s`, as `Store.ride_out` words it."""
    return unreachable_for(down.where, now - down.since, down.what, patience_s, down.error)
