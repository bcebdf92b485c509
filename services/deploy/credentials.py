"""The Redis users' passwords of a deployed cluster, and the ACL file Redis loads.

A password is the key set's ``redis/USER.password`` where the set holds one
(the layout `common.locate` reads), else derived from the coordinator's secret
key: derived rather than stored, so that every deploy computes the same files
(and so changes nothing) and no further secret needs keeping. Only hashes
reach the ACL file; a service gets its own role's password and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from urllib.parse import quote

from common.curve import COORDINATOR, FOLDERS
from common.errors import ConfigError
from services.deploy.inventory import Inventory

__all__ = [
    "PASSWORD_DIR",
    "REDIS_USERS",
    "acl_file",
    "redis_password",
    "redis_passwords",
    "redis_url",
]

REDIS_USERS = ("coordinator", "worker", "planner", "profiler", "operator", "admin")
"""The users of deploy/redis-acl.conf, one per role."""
PASSWORD_DIR = "redis"
"""Folder of a key set with a ``USER.password`` file per Redis user, where it has one."""

_PLACEHOLDER = re.compile(r"#SHA256_OF_([A-Z]+)_PASSWORD")


def redis_password(coordinator_secret: bytes, cluster: str, user: str) -> str:
    """A Redis user's password derived from the coordinator's secret key (HMAC-SHA256)."""
    msg = f"asteroid-edge redis {cluster} {user}".encode()
    return hmac.new(coordinator_secret, msg, hashlib.sha256).hexdigest()[:40]


def redis_passwords(inv: Inventory, keys: Mapping[str, bytes]) -> dict[str, str]:
    """Every Redis user's password: the key set's ``redis/USER.password``, else derived."""
    secret = keys.get(f"{FOLDERS['coordinator']}/{COORDINATOR}.key_secret")
    if secret is None:
        raise ConfigError("the key set has no coordinator secret key (run `asteroid keys init`)")
    out = {}
    for user in REDIS_USERS:
        stored = keys.get(f"{PASSWORD_DIR}/{user}.password")
        text = stored.decode("utf-8", "replace").strip() if stored is not None else ""
        if stored is not None and (not text or any(ord(ch) <= 32 for ch in text)):
            raise ConfigError(f"Redis password file {PASSWORD_DIR}/{user}.password is malformed")
        out[user] = text or redis_password(secret, inv.cluster, user)
    return out


def redis_url(inv: Inventory, user: str, password: str | None = None) -> str:
    """The URL of the cluster's Redis as `user` (without a password: it is then in a file)."""
    host = inv.coordinator.removeprefix("tcp://").rsplit(":", 1)[0]
    auth = user if password is None else f"{user}:{quote(password, safe='')}"
    return f"redis://{auth}@{host}:{inv.redis_port}/0"


def acl_file(template: str, passwords: Mapping[str, str]) -> bytes:
    """The ACL file (comments dropped, placeholders replaced by password hashes)."""
    lines = []
    for line in template.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PLACEHOLDER.search(line)
        if m:
            user = m.group(1).lower()
            if user not in passwords:
                raise ConfigError(f"the Redis ACL template names user {user!r} this deploy lacks")
            digest = hashlib.sha256(passwords[user].encode()).hexdigest()
            line = line[: m.start()] + f"#{digest}" + line[m.end() :]
        lines.append(line.strip())
    if not lines:
        raise ConfigError("the Redis ACL template holds no user")
    return ("\n".join(lines) + "\n").encode()
