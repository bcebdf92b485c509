"""Whether Redis answers this device, and lets it log in; and Redis's clock, as a fallback.

The URL is the one the worker would use: configured (flag or ASTEROID_REDIS_URL),
else built from where the coordinator says Redis is and the password of this
device's role in its key set (`common.locate`), so a login refused here is the
login the worker would be refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from common.errors import StoreError
from common.secrets import mask_text
from common.store import Store
from services.cli.doctor.report import Check

__all__ = ["Reply", "probe", "redis_check"]


@dataclass(frozen=True)
class Reply:
    """What one PING (and TIME) of Redis gave.

    Attributes:
        where: The URL, password hidden.
        error: The client's exception, None when Redis answered.
        offset_s: Redis's clock minus this host's, None when unknown (TIME denied).
        rtt_s: The TIME round trip: the offset is known to within half of it.

    """

    where: str
    error: BaseException | None = None
    offset_s: float | None = None
    rtt_s: float | None = None


def probe(url: str, cluster: str, timeout_s: float) -> Reply:
    """PING Redis at `url`, then read its clock if this user may; each bounded by `timeout_s`."""
    store = Store(url, cluster, timeout_s=timeout_s, connect_timeout_s=timeout_s)
    try:
        try:
            store.ping()
        except StoreError as exc:
            return Reply(store.where, exc.__cause__ or exc)
        try:
            sent = time.time()
            server = store.server_time()
            got = time.time()
        except redis.RedisError:  # an ACL without TIME (the worker's): no clock, no problem
            return Reply(store.where)
        return Reply(store.where, None, server - (sent + got) / 2, got - sent)
    finally:
        store.close()


def redis_check(reply: Reply, user: str | None, timeout_s: float) -> Check:
    """The `redis` row: answers, refuses the login (and why), or is not there."""
    who = f" as {user}" if user else ""
    data = {"url": reply.where, "user": user}
    exc = reply.error
    if exc is None:
        return Check("redis", "ok", f"answers at {reply.where}{who}", data=data)
    reason = mask_text(str(exc)) or type(exc).__name__
    if isinstance(exc, redis.AuthenticationError):
        name = user or "default"
        return Check(
            "redis",
            "problem",
            f"Redis at {reply.where} refused the login{who}: {reason}",
            f"put Redis user {name}'s password in KEYS/redis/{name}.password (chmod 600), or "
            "pass --redis-url redis://USER@HOST:PORT/0 with --redis-password-file FILE",
            data,
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return Check(
            "redis",
            "problem",
            f"Redis at {reply.where} denies PING{who}: {reason}",
            "give the user +ping in Redis's ACL (deploy/redis-acl.conf)",
            data,
        )
    host = reply.where.partition("@")[2] or reply.where.partition("://")[2]
    host = host.split("/", 1)[0]
    if isinstance(exc, redis.TimeoutError):
        summary = f"no answer from Redis at {reply.where} within {timeout_s:g} s"
    else:
        summary = f"Redis at {reply.where} does not answer: {reason}"
    return Check(
        "redis",
        "problem",
        summary,
        f"start Redis on {host} (sudo systemctl start redis-server) and open its port, or pass "
        "the right --redis-url",
        data,
    )
