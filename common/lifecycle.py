"""The states a job goes through, as a pure transition table.

submitted -> profiling -> planning -> running -> finished, and from any
state before the end to failed or cancelled. A running job whose devices are
lost goes to recovering and, once re-planned on the survivors, back to running; one
that takes in a device that joined, or lets a drained one go, is replanning meanwhile.
Kept pure so the rules are tested without sockets; the coordinator records each
transition in Redis. Shared in `common` because clients that follow a job (the
CLI) need to know which states end it.
"""

from __future__ import annotations

from typing import Literal, get_args

from common.errors import AsteroidError

__all__ = ["ACTIVE", "TERMINAL", "JobState", "advance"]

JobState = Literal[
    "submitted",
    "profiling",
    "planning",
    "running",
    "recovering",
    "replanning",
    "finished",
    "failed",
    "cancelled",
]
TERMINAL: frozenset[JobState] = frozenset({"finished", "failed", "cancelled"})
ACTIVE: frozenset[JobState] = frozenset(get_args(JobState)) - TERMINAL

_NEXT: dict[JobState, frozenset[JobState]] = {
    "submitted": frozenset({"profiling", "planning", "running"}),
    "profiling": frozenset({"planning"}),
    "planning": frozenset({"running"}),
    "running": frozenset({"finished", "recovering", "replanning"}),
    "recovering": frozenset({"running"}),
    "replanning": frozenset({"running", "recovering"}),
}


def advance(state: JobState, to: JobState) -> JobState:
    """`to`, if a job in `state` may move there; raises AsteroidError otherwise.

    From submitted a job may skip profiling (profiles cached or a plan given)
    and planning (a plan given). Failing and cancelling are allowed from every
    active state; nothing leaves a terminal state.
    """
    if state in TERMINAL:
        raise AsteroidError(f"job is already {state}; it cannot become {to}")
    if to in ("failed", "cancelled") or to in _NEXT[state]:
        return to
    raise AsteroidError(f"a {state} job cannot become {to}")
