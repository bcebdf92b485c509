"""The names a job spec may give as its planner.

The planners themselves live in the planner service; the coordinator and the
CLI only need their names to refuse a misspelled one before a job starts, so
the names are listed here rather than imported from the planner. A planner
test checks this list against the planners actually registered.
"""

from __future__ import annotations

__all__ = ["PLANNER_NAMES"]

PLANNER_NAMES: frozenset[str] = frozenset(
    {"asteroid", "dapple", "dp", "duanwu", "gpipe", "hetpipe", "optimal", "pipedream"}
)
