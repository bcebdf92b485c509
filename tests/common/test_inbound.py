"""The memory guard: when it says a socket must be reset, and to whom when sockets share it."""

from __future__ import annotations

from common.inbound import MemoryGuard, rss_bytes


def test_a_process_below_its_limit_resets_nothing():
    guard = MemoryGuard.above_now(1 << 30, every_s=0.0)
    assert not guard.exceeded() and guard.resets == 0


def test_above_the_limit_it_says_so_at_most_once_per_period():
    guard = MemoryGuard(limit=0, every_s=3600.0)  # any process is above 0 bytes
    assert rss_bytes() > 0
    assert guard.exceeded() and guard.resets == 1
    assert not guard.exceeded()  # not due again for an hour


def test_every_socket_sharing_a_guard_is_told_of_each_excess():
    # the idle socket's loop asks first and at every turn; the flooded one must still hear
    guard = MemoryGuard(limit=0, every_s=3600.0)
    idle, flooded = guard.watch(), guard.watch()
    assert idle.exceeded()
    assert not idle.exceeded()
    assert flooded.exceeded()
    assert not flooded.exceeded()
    assert (idle.resets, flooded.resets, flooded.limit) == (1, 1, 0)
