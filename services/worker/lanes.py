"""Duan & Wu's lanes for the worker: `services.lib.lanes` (the profiler's measurement uses them)."""

from __future__ import annotations

from services.lib.lanes import (
    SplitLanes,
    bound_to,
    device_cores,
    lane_cores,
    single_thread,
    split_threads,
)

__all__ = [
    "SplitLanes",
    "bound_to",
    "device_cores",
    "lane_cores",
    "single_thread",
    "split_threads",
]
