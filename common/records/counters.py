"""The cluster's counters: the coordinator ``fence`` and the plan ``epoch``.

Each only ever grows, taken with INCR so that two coordinators never hold the
same value: workers refuse a coordinator whose fence is older than one they
have seen, and a plan's epoch tells its messages from an older plan's.
"""

from __future__ import annotations

from common.store import Store

__all__ = ["raise_fence", "raise_plan_epoch"]


def raise_fence(store: Store) -> int:
    """Take the next coordinator fence (1 for the first coordinator of a cluster)."""
    return store.incr("fence")


def raise_plan_epoch(store: Store) -> int:
    """Take the next plan epoch."""
    return store.incr("epoch")
