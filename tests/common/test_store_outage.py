"""`Store.ride_out`: what waits out a Redis outage, and what does not.

The operation and the clock between attempts are fakes here; the real outage
(a redis-server killed mid-job) is tests/security/test_redis_outage.py.
"""

from __future__ import annotations

import time

import pytest
import redis

from common.errors import StoreUnavailable
from common.store import Store

SECRET = "s3cret-pw"


@pytest.fixture
def store():
    # nothing listens there; the fake operations never touch it
    s = Store(f"redis://:{SECRET}@127.0.0.1:1/0", "outage-unit")
    yield s
    s.close()


class Flaky:
    """Raises `errors` one by one, then returns "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_an_outage_shorter_than_the_patience_is_waited_out_with_growing_pauses(store):
    op = Flaky(*[redis.ConnectionError("refused")] * 6, redis.TimeoutError("timed out"))
    pauses: list[float] = []
    assert store.ride_out(op, "committing round 3", 600, pauses.append) == "done"
    assert op.calls == 8
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]  # doubling, capped at 2 s


def test_an_outage_that_outlasts_the_patience_fails_naming_what_waited(store):
    op = Flaky(*[redis.ConnectionError("Connection refused.")] * 1000)
    with pytest.raises(StoreUnavailable) as err:
        store.ride_out(op, "committing round 3", 0.3, time.sleep)
    text = str(err.value)
    assert "Redis at" in text and "while committing round 3 (patience 0.3 s)" in text
    assert "Connection refused." in text and SECRET not in text  # the URL is masked


def test_an_idle_that_raises_ends_the_wait(store):
    class Stopped(Exception):
        pass

    def idle(_: float) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        store.ride_out(Flaky(redis.ConnectionError("refused")), "loading", 600, idle)


@pytest.mark.parametrize(
    "error", [redis.ResponseError("WRONGTYPE"), redis.DataError("bad value"), KeyError("x")]
)
def test_errors_that_are_not_an_outage_are_raised_at_once(store, error):
    op = Flaky(error)
    with pytest.raises(type(error)):
        store.ride_out(op, "loading", 600, lambda s: pytest.fail("must not wait"))
    assert op.calls == 1
