"""Where the cluster's Redis is, learnt from the coordinator: a device needs only its address.

A worker, a profiler or the CLI started without a Redis URL asks the
coordinator (LocateRedis); the answer (RedisLocation) names host, port, db and
key prefix, never a credential. The password comes from the device's own key
set, ``KEYS/redis/USER.password`` (USER is the role's Redis ACL user of
`deploy/redis-acl.conf`: worker, profiler, operator), so the control plane
carries no secret and each device holds only its role's password.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis.connection
import zmq

from common.codec import Limits, encode, recv_message
from common.curve import COORDINATOR, CurveKeys, is_loopback
from common.errors import ConfigError, ProtocolError, Unreachable
from common.logging import get_logger
from common.messages import CLUSTER_PATTERN, LocateRedis, RedisLocation
from common.secrets import mask_url
from common.settings import CommonSettings
from common.sockets import connect_dealer

__all__ = [
    "PASSWORD_DIR",
    "CoordinatorUnreachable",
    "coordinator_host",
    "locate",
    "location_of",
    "password_file",
    "read_password",
    "redis_url_for",
    "with_redis",
]

log = get_logger(__name__)
S = TypeVar("S", bound=CommonSettings)

PASSWORD_DIR = "redis"
"""Folder of a key set holding one ``USER.password`` file per Redis ACL user."""
MAX_PASSWORD_BYTES = 512
"""Longest password file read: a password, not a file someone pointed here by mistake."""
ATTEMPT_S = 3.0
"""Longest wait for one answer before the request is sent again."""
NOTE_EVERY_S = 5.0
"""How often a device that cannot reach its coordinator says so."""
_SENT_KEPT = 64
"""Nonces of unanswered requests kept: any of their answers will do."""


class CoordinatorUnreachable(Unreachable):
    """No coordinator answered where Redis is, in the time allowed."""


def coordinator_host(address: str) -> str:
    """HOST of ``tcp://HOST:PORT`` (an IPv6 address without its brackets).

    Raises:
        ConfigError: Not a tcp:// address with a host and a port.

    """
    transport, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if transport != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ConfigError(f"coordinator address {address!r} is not tcp://HOST:PORT")
    return host.strip("[]")


def location_of(redis_url: str, cluster: str, nonce: int) -> RedisLocation:
    """What a coordinator using `redis_url` and `cluster` tells a device asking with `nonce`.

    A Redis on the coordinator's loopback is named by an empty host: the device
    then uses the coordinator's host as it reaches it. A Unix socket cannot be
    reached from another machine, and a cluster name outside `CLUSTER_PATTERN`
    cannot be told; both answer with an error instead.
    """
    try:
        parts = redis.connection.parse_url(redis_url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        return RedisLocation(nonce=nonce, error=f"the coordinator's Redis URL is invalid: {exc}")
    if "path" in parts:
        return RedisLocation(
            nonce=nonce,
            error="the coordinator reaches Redis over a Unix socket, which other machines "
            "cannot: give the device --redis-url",
        )
    try:
        return RedisLocation(
            nonce=nonce,
            host="" if is_loopback(f"tcp://{parts.get('host', '')}:0") else parts.get("host", ""),
            port=int(parts.get("port", 6379)),
            db=int(parts.get("db", 0)),
            tls=parts.get("connection_class") is redis.connection.SSLConnection,
            cluster=cluster,
        )
    except ValueError as exc:  # pydantic's ValidationError: a host or cluster out of pattern
        return RedisLocation(
            nonce=nonce,
            error=f"the coordinator's Redis host or cluster {cluster!r} cannot be told to "
            f"devices (cluster names match {CLUSTER_PATTERN}): {str(exc).splitlines()[0]}",
        )


def redis_url_for(loc: RedisLocation, coordinator: str, user: str, password: str | None) -> str:
    """The URL a device connects with: the location, as `user` with `password` if it has one."""
    host = loc.host or coordinator_host(coordinator)
    host = f"[{host}]" if ":" in host else host
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password is not None else ""
    return f"{'rediss' if loc.tls else 'redis'}://{auth}{host}:{loc.port}/{loc.db}"


def password_file(keys_root: Path, user: str) -> Path:
    """Where a key set keeps Redis user `user`'s password."""
    return keys_root / PASSWORD_DIR / f"{user}.password"


def read_password(keys_root: Path | None, user: str) -> str | None:
    """Redis user `user`'s password from the key set; None without a key set or that file.

    Raises:
        ConfigError: The file is unreadable, empty, too long or holds control characters.

    """
    if keys_root is None:
        return None
    path = password_file(keys_root, user)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PASSWORD_BYTES + 2)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the Redis password file {path}: {exc}") from exc
    text = raw.decode("utf-8", "replace").removesuffix("\n").removesuffix("\r")
    if not text or len(text.encode()) > MAX_PASSWORD_BYTES:
        raise ConfigError(
            f"Redis password file {path} must hold one password of 1 to {MAX_PASSWORD_BYTES} bytes"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ConfigError(f"Redis password file {path} holds control characters or several lines")
    if path.stat().st_mode & 0o077:
        log.warning("Redis password file is readable by others; chmod 600 it", path=str(path))
    return text


def with_redis(
    settings: S,
    keys: CurveKeys | None,
    user: str,
    stop: Callable[[], bool] = lambda: False,
    patience_s: float = float("inf"),
) -> S:
    """`settings` with the Redis URL and cluster to use: as configured, else the coordinator's.

    Only when no Redis URL was configured (flag or ASTEROID_REDIS_URL) is the
    coordinator asked (`locate`); the URL then logs in as Redis user `user`
    with the password of the key set, if it holds one. A cluster configured
    explicitly wins over the coordinator's.
    """
    if "redis_url" in settings.model_fields_set:
        return settings
    loc = locate(settings.coordinator, keys, stop, patience_s)
    url = redis_url_for(loc, settings.coordinator, user, read_password(settings.keys, user))
    cluster = settings.cluster if "cluster" in settings.model_fields_set else loc.cluster
    log.info("learnt where Redis is from the coordinator", redis=mask_url(url), cluster=cluster)
    return settings.model_copy(update={"redis_url": url, "cluster": cluster})


def locate(
    coordinator: str,
    keys: CurveKeys | None,
    stop: Callable[[], bool] = lambda: False,
    patience_s: float = float("inf"),
    attempt_s: float = ATTEMPT_S,
) -> RedisLocation:
    """Ask the coordinator at `coordinator` where Redis is, until it answers.

    Asked again every `attempt_s`; while no answer comes, a warning every
    `NOTE_EVERY_S` says which coordinator is unreachable, so a device waiting
    on a wrong address or a closed port says so. Gives up when `stop()` turns
    true or after `patience_s`.

    Raises:
        CoordinatorUnreachable: No answer within `patience_s`, or stopped.
        ConfigError: The coordinator answered that it cannot tell (its `error`).

    """
    ctx: zmq.Context[Any] = zmq.Context()
    session = f"locate-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    identity = f"{keys.name}/{session}" if keys else session
    server_key = keys.server_key("coordinator", COORDINATOR) if keys else None
    sock = connect_dealer(ctx, coordinator, identity, keys=keys, server_key=server_key)
    sent: deque[int] = deque(maxlen=_SENT_KEPT)
    began = time.monotonic()
    next_note = began + NOTE_EVERY_S
    try:
        for attempt in itertools.count(1):
            nonce = secrets.randbelow(2**63)
            sent.append(nonce)
            with contextlib.suppress(zmq.Again):  # no connection to queue on: ask again later
                sock.send_multipart(encode(LocateRedis(nonce=nonce), identity), zmq.NOBLOCK)
            answer = _await(sock, sent, time.monotonic() + attempt_s, stop)
            if answer is not None:
                if answer.error:
                    raise ConfigError(f"the coordinator at {coordinator}: {answer.error}")
                if attempt > 1:
                    log.info("reached the coordinator", coordinator=coordinator)
                return answer
            now = time.monotonic()
            if stop() or now - began >= patience_s:
                raise CoordinatorUnreachable(
                    f"no coordinator answered at {coordinator} within {now - began:.0f} s "
                    "(is asteroid-coordinator running there, and its port open? with --keys, "
                    "is this the cluster's key set?)"
                )
            if now >= next_note:
                next_note = now + NOTE_EVERY_S
                log.warning(
                    "cannot reach the coordinator to learn where Redis is; still trying",
                    coordinator=coordinator,
                    waited_s=round(now - began, 1),
                )
        raise AssertionError("unreachable")  # pragma: no cover - the loop only returns or raises
    finally:
        sock.close(0)
        ctx.term()


def _await(
    sock: zmq.Socket[Any], sent: deque[int], deadline: float, stop: Callable[[], bool]
) -> RedisLocation | None:
    """The first RedisLocation answering one of `sent` before `deadline`, else None."""
    limits = Limits(max_tensor_bytes=0, max_tensors=0)
    while (left := deadline - time.monotonic()) > 0 and not stop():
        if not sock.poll(int(min(left, 0.2) * 1000) or 1, zmq.POLLIN):
            continue
        try:
            _, env = recv_message(sock, limits)
        except ProtocolError as exc:
            log.warning("dropped bad message", peer="coordinator", reason=exc.reason)
            continue
        if isinstance(env.msg, RedisLocation) and env.msg.nonce in sent:
            return env.msg
    return None
