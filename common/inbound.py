"""A memory bound on what peers send a bound socket, where ZeroMQ has none.

ZeroMQ delivers a multipart message only once its last frame has arrived, and
until then keeps every frame in the connection's pipe: RCVHWM counts whole
messages and MAXMSGSIZE bounds one frame, so a peer that sends frame after
frame with the MORE flag and never a last one grows the receiving process
without bound (75,000 frames of 4 KiB: +600 MB), and no socket option caps
frames or bytes per message (libzmq 4.3). What the process can see is its own
size: a `MemoryGuard` watches the resident set against a limit, first hands
freed memory back (a sender that left has its partial message dropped by
ZeroMQ, but the allocator keeps the pages), and only if that is not enough
says the listening socket must be reset: closing it drops every connection's
unfinished message, honest peers' DEALERs reconnect on their own within
ZeroMQ's reconnect interval, and the flooder starts from nothing again.

A process with several listening sockets cannot tell which one a flood
arrives on, so they share one guard, each through its own `GuardWatch`: every
watch is told of every excess and resets its socket. (Telling only whichever
socket asked first let an idle socket's loop, asking every 0.1 s, take every
turn while the flooded one, still inside its own poll, never reset.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Guard", "GuardWatch", "MemoryGuard", "release_freed_memory", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC_NAME = ctypes.util.find_library("c")
_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None


def rss_bytes() -> int:
    """The resident set of this process, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def release_freed_memory() -> None:
    """Return the allocator's free pages to the system (glibc's malloc_trim; else nothing)."""
    if _TRIM is not None:
        _TRIM(0)


@dataclass
class MemoryGuard:
    """Says when the process has outgrown `limit` bytes by what peers sent it.

    `limit` is the process's own planned size plus a margin; `exceeded` costs
    one read of /proc every `every_s` seconds, nothing in between, so a
    receive loop may ask it on every turn.
    """

    limit: int
    every_s: float = 0.1
    resets: int = 0
    """Times `exceeded` said yes (each is a socket reset by its caller)."""
    _next: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def exceeded(self) -> bool:
        """True when the process is above its limit even after handing freed memory back."""
        if time.monotonic() < self._next:
            return False
        with self._lock:  # sockets of several threads may share the guard (`watch`)
            now = time.monotonic()
            if now < self._next:
                return False
            self._next = now + self.every_s
            if rss_bytes() <= self.limit:
                return False
            release_freed_memory()
            if rss_bytes() <= self.limit:
                return False
            self.resets += 1
            return True

    def watch(self) -> GuardWatch:
        """A view of this guard for one of several sockets that share it."""
        return GuardWatch(self)

    @classmethod
    def above_now(cls, margin: int, every_s: float = 0.1) -> MemoryGuard:
        """A guard for a process that may grow `margin` bytes beyond its size now."""
        return cls(limit=rss_bytes() + margin, every_s=every_s)


class Guard(Protocol):
    """What a receive loop asks: a `MemoryGuard` of its own or its watch of a shared one."""

    @property
    def limit(self) -> int:
        """Bytes the process may reach."""
        ...

    @property
    def resets(self) -> int:
        """Excesses so far."""
        ...

    def exceeded(self) -> bool:
        """True when this socket should be reset."""
        ...


@dataclass
class GuardWatch:
    """One socket's view of a shared `MemoryGuard`: told of every excess, whoever saw it."""

    guard: MemoryGuard
    _seen: int = 0

    @property
    def limit(self) -> int:
        """The shared guard's limit."""
        return self.guard.limit

    @property
    def resets(self) -> int:
        """The shared guard's excesses so far."""
        return self.guard.resets

    def exceeded(self) -> bool:
        """True once for each excess since this watch last said so (checking when due)."""
        self.guard.exceeded()
        if self.guard.resets == self._seen:
            return False
        self._seen = self.guard.resets
        return True
