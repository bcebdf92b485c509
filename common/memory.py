"""Process-level memory tuning for workers.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a
fresh mmap and returns it on free, so each large activation, gradient or
received frame pays page faults again: on small VMs that costs three times the
copy itself. Raising the mmap and trim thresholds keeps freed memory in the
heap for reuse. The trade-off: a worker's resident memory stays at its peak,
which is what a steady training loop needs anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Ask glibc to reuse freed large blocks; False where that is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
