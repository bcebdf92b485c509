"""The checks `asteroid doctor` runs, in the order it shows them, and the key set it uses.

Kept apart from the command so that registering `asteroid doctor` (at every
`asteroid` start) does not import what the checks need: ZeroMQ, redis, the
device probes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from common.curve import FOLDERS, CurveKeys
from common.errors import ConfigError
from services.cli.doctor.clock import clock_check
from services.cli.doctor.coordinator import Visit, coordinator_checks, visit
from services.cli.doctor.host import host_checks
from services.cli.doctor.ports import port_check
from services.cli.doctor.report import Check
from services.cli.doctor.store import Reply, probe, redis_check

if TYPE_CHECKING:
    from common.settings import WorkerSettings

__all__ = ["REDIS_USERS", "pick_keys", "run_checks"]

REDIS_USERS = {"worker": "worker", "service": "profiler", "operator": "operator"}
"""The Redis ACL user (deploy/redis-acl.conf) each role of key logs in as."""
ROLES = ("worker", "service", "operator")
"""Whose key a device's set holds, in the order doctor looks: a device runs a worker."""


def pick_keys(root: Path, device: str | None) -> CurveKeys:
    """The device's pair in `root`: the worker `device`, else the one secret key of a role.

    A device's copy of the set holds its own secret key only, so the first role
    folder with exactly one is whose the device is (a worker's, before a
    profiler's, before an operator's).
    """
    if device:
        return CurveKeys.load(root, "worker", device)
    for role in ROLES:
        if len(list((root / FOLDERS[role]).glob("*.key_secret"))) == 1:
            return CurveKeys.load(root, role)
    raise ConfigError(
        f"the key set {root} holds no single secret key of a worker, service or operator "
        "(a device's copy holds its own only): pass --device NAME for the worker's key"
    )


def _keys(root: Path | None, device: str | None) -> tuple[CurveKeys | None, list[Check]]:
    """The device's keys, and what is wrong with them (none, unreadable, open to others)."""
    if root is None:
        return None, []
    try:
        keys = pick_keys(root, device)
    except (ConfigError, OSError, ValueError) as exc:
        return None, [
            Check(
                "key set",
                "problem",
                f"cannot use the key set {root}: {exc}",
                f"copy this device's key set here from where `asteroid keys init {root}` made it",
            )
        ]
    secret = keys.root / FOLDERS[keys.role] / f"{keys.name}.key_secret"
    if secret.stat().st_mode & 0o077:
        return keys, [
            Check(
                "key set",
                "problem",
                f"{secret} is readable by other users",
                f"chmod 600 {secret}",
            )
        ]
    return keys, [Check("key set", "ok", f"{keys.role}:{keys.name} in {root}")]


def _redis_target(
    s: WorkerSettings, v: Visit | None, user: str | None
) -> tuple[str, str, str | None] | Check:
    """(URL, cluster, user) the worker would use, or the row saying why it cannot be told."""
    from common.locate import read_password, redis_url_for

    if "redis_url" in s.model_fields_set:
        return s.redis_url, s.cluster, urlsplit(s.redis_url).username
    if not {"coordinator", "keys"} & s.model_fields_set:
        return s.redis_url, s.cluster, None  # a local cluster: the default URL
    loc = v.location if v is not None else None
    if loc is None or loc.error:
        why = loc.error if loc is not None else "the coordinator did not say where it is"
        return Check(
            "redis",
            "skipped",
            f"not known: {why}",
            "pass --redis-url redis://HOST:6379/0 to check it directly",
        )
    name = user or "worker"
    try:
        url = redis_url_for(loc, s.coordinator, name, read_password(s.keys, name))
    except ConfigError as exc:
        return Check(
            "redis", "problem", str(exc), f"chmod 600 the file, one line: {name}'s password"
        )
    cluster = s.cluster if "cluster" in s.model_fields_set else loc.cluster
    return url, cluster, urlsplit(url).username  # no password file: no user either


def _bind_host(s: WorkerSettings) -> str:
    """The interface the worker binds its data and link sockets on (its own rule)."""
    from services.worker.addressing import data_hosts

    # any advertised host will do: only the bind half is wanted, without a route lookup
    return data_hosts(s.data_host, "-", s.coordinator)[0]


def run_checks(s: WorkerSettings, timeout_s: float) -> list[Check]:
    """Every check, in the order they are shown."""
    checks = host_checks(s.accelerator)
    keys, key_rows = _keys(s.keys, s.device or None)
    checks += key_rows
    v: Visit | None = None
    if s.keys is not None and keys is None:
        checks.append(Check("coordinator", "skipped", "not visited: the key set is unusable"))
    else:
        v = visit(s.coordinator, keys, timeout_s)
        checks += coordinator_checks(v, keys, timeout_s)
    target = _redis_target(s, v, REDIS_USERS[keys.role] if keys else None)
    reply: Reply | None = None
    if isinstance(target, Check):
        checks.append(target)
    else:
        url, cluster, user = target
        reply = probe(url, cluster, timeout_s)
        checks.append(redis_check(reply, user, timeout_s))
    if v is not None and v.offset_s is not None:
        checks.append(clock_check(v.offset_s, v.rtt_s, "coordinator"))
    elif reply is not None and reply.offset_s is not None:
        checks.append(clock_check(reply.offset_s, reply.rtt_s, "redis"))
    else:
        checks.append(clock_check(None, None, ""))
    host = _bind_host(s)
    checks.append(port_check("data port", "--data-port", host, s.data_port))
    checks.append(port_check("link port", "--link-port", host, s.link_port))
    return checks
