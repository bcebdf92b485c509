"""Where the cluster of `asteroid up` runs on this machine: a lock, a file, and the look-up.

`asteroid up` and `asteroid demo` hold an exclusive lock on their state folder
(``STATE/lock``) for their whole life and, once their services answer, write
``STATE/cluster.json`` (mode 600): the coordinator, the Redis URL and the
cluster's key prefix. Every CLI command resolves its settings through
`resolve_settings`, so `asteroid status` or `asteroid train JOB.yaml` in another
terminal finds the running cluster without copying addresses (Ray's
``address="auto"``).

The lock, not the pid, says whether that cluster is alive: the kernel releases
a flock however its owner ends, so a file left by a killed `up` is ignored and
then replaced, never trusted. A second `up` on the same folder (which would load
the live cluster's append-only file) refuses, naming the first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.errors import ConfigError, validation_message
from common.secrets import mask_url
from common.settings import CommonSettings

__all__ = [
    "LocalCluster",
    "Origin",
    "Resolved",
    "StateClaim",
    "StateDirBusy",
    "claim_state_dir",
    "cluster_file",
    "default_state_dir",
    "find_local_cluster",
    "resolve",
    "resolve_settings",
    "tcp_listening",
]

CLUSTER_FILE = "cluster.json"
LOCK_FILE = "lock"
MAX_FILE_BYTES = 16 << 10
"""Largest cluster file read: what `up` writes is a few hundred bytes."""
CLAIM_PATIENCE_S = 1.0
"""How long `claim_state_dir` retries a held lock: a reader's probe holds it for microseconds."""

_COORDINATOR = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")
_NO_CONTROLS = re.compile(r"^[^\x00-\x1f\x7f-\x9f\s]+$")


def default_state_dir() -> Path:
    """The local cluster's state folder: `$XDG_STATE_HOME/asteroid`.

    `XDG_STATE_HOME` defaults to `~/.local/state`, the XDG base-directory place
    for state that should outlive a run but is not worth a backup. It holds the
    lock, the cluster file and the embedded Redis's folder (``redis/``).
    """
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "asteroid"


def cluster_file(state_dir: Path | None = None) -> Path:
    """Where `up` on `state_dir` (default: `default_state_dir`) says where its cluster is."""
    return (state_dir or default_state_dir()) / CLUSTER_FILE


def tcp_listening(address: str, timeout_s: float = 1.0) -> bool | None:
    """Whether something accepts connections at ZeroMQ address `address` (None: not tcp).

    A TCP connect, refused at once on a port nobody listens on: how the CLI
    tells "no cluster at all" in a moment instead of waiting out a request.
    """
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _lock_file(state_dir: Path) -> Path:
    return state_dir / LOCK_FILE


class LocalCluster(BaseModel):
    """What `asteroid up` tells the CLI: where its coordinator and Redis are, and since when.

    Strict and bounded, since whoever can write the file decides where the CLI
    sends jobs: only a `tcp://HOST:PORT` coordinator, a Redis URL
    of a known scheme, names without control characters.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str = Field(max_length=300)
    redis_url: str = Field(max_length=2000)
    cluster: str = Field(min_length=1, max_length=200)
    pid: int = Field(gt=0)
    state_dir: Path
    started_at: float = Field(ge=0)
    dashboard_url: str | None = Field(None, max_length=300)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        """Fields as repr() shows them: the Redis URL without its password."""
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "redis_url" and isinstance(value, str) else value

    @field_validator("coordinator")
    @classmethod
    def _tcp_address(cls, value: str) -> str:
        if not _COORDINATOR.match(value):
            raise ValueError("expected tcp://HOST:PORT")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")) or not _NO_CONTROLS.match(
            value
        ):
            raise ValueError("expected redis://HOST:PORT/DB (or rediss://, unix://)")
        return value

    @field_validator("cluster", "dashboard_url")
    @classmethod
    def _one_word(cls, value: str | None) -> str | None:
        if value is not None and not _NO_CONTROLS.match(value):
            raise ValueError("expected one word without spaces or control characters")
        return value


class StateDirBusy(ConfigError):
    """Another `asteroid up` holds the state folder's lock."""


def _read_bounded(path: Path) -> bytes | None:
    """The bytes of our own regular file `path` (no symlink), or None when there is none.

    A file another user could have written, or one far larger than `up`
    writes, is refused with ConfigError naming it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link; `asteroid up` writes a file") from None
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ConfigError(
                f"{path} is not a private file of this user (owner, mode or kind); remove it"
            )
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_FILE_BYTES} bytes; remove it")
    return data


def _parse(path: Path, data: bytes) -> LocalCluster:
    try:
        return LocalCluster.model_validate_json(data)
    except ValidationError as exc:
        raise ConfigError(
            f"{path} is not a cluster file `asteroid up` wrote ({validation_message(exc)}); "
            "remove it"
        ) from None


def _lock_owner(state_dir: Path) -> int | None:
    """The pid the lock's holder wrote into the lock file, None if unreadable."""
    try:
        text = _read_bounded(_lock_file(state_dir))
    except ConfigError:
        return None
    if text is None or not text.strip().isdigit():
        return None
    return int(text.strip())


def _lock_held(state_dir: Path) -> bool:
    """Whether some process holds the state folder's lock (a shared try-lock fails).

    Opened read-only and never created: looking must not change the folder.
    """
    try:
        fd = os.open(_lock_file(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def find_local_cluster(state_dir: Path | None = None) -> LocalCluster | None:
    """The cluster `asteroid up` runs on `state_dir` now, or None.

    None when there is no file, when nobody holds the lock (the `up` that wrote
    it is gone), or when the file is an earlier owner's (its pid is not the
    lock holder's). A file of the live owner that does not validate raises
    ConfigError naming it, rather than silently pointing the CLI elsewhere.
    """
    folder = state_dir or default_state_dir()
    path = cluster_file(folder)
    if not path.exists() or not _lock_held(folder):
        return None
    data = _read_bounded(path)
    if data is None:
        return None
    found = _parse(path, data)
    return found if found.pid == _lock_owner(folder) else None


@dataclass
class StateClaim:
    """The lock on a state folder, held by one `up`; it publishes the cluster file."""

    state_dir: Path
    fd: int

    def publish(self, cluster: LocalCluster) -> Path:
        """Write `cluster` to the cluster file (mode 600, replaced atomically); its path."""
        path = cluster_file(self.state_dir)
        tmp = path.with_name(f".{CLUSTER_FILE}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cluster.model_dump_json())
        os.replace(tmp, path)
        return path

    def withdraw(self) -> None:
        """Remove the cluster file (idempotent): this cluster is going away."""
        with contextlib.suppress(FileNotFoundError):
            cluster_file(self.state_dir).unlink()


def _busy_message(state_dir: Path) -> str:
    """Who holds `state_dir`: the live cluster file's owner, else the lock file's pid."""
    first = ""
    with contextlib.suppress(ConfigError):
        found = find_local_cluster(state_dir)
        if found is not None:
            first = f" (pid {found.pid}, coordinator {found.coordinator}, cluster {found.cluster})"
    if not first and (pid := _lock_owner(state_dir)) is not None:
        first = f" (pid {pid})"
    return (
        f"the state folder {state_dir} is in use by another `asteroid up`{first}: "
        "use that cluster, stop it first, or give this one its own --state-dir"
    )


def _try_lock(fd: int, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def claim_state_dir(state_dir: Path | None = None) -> Iterator[StateClaim]:
    """Hold `state_dir`'s lock for the body; StateDirBusy if another process holds it.

    The lock file stays (unlinking a lock file races a process about to lock
    it); the pid written into it names the holder. A cluster file left by a
    dead owner is removed at once, and this claim's own one on the way out.
    """
    folder = state_dir or default_state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(_lock_file(folder), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not _try_lock(fd, CLAIM_PATIENCE_S):
            raise StateDirBusy(_busy_message(folder))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        claim = StateClaim(folder, fd)
        claim.withdraw()  # a dead owner's file
        try:
            yield claim
        finally:
            claim.withdraw()
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


Origin = Literal["option", "environment", "local cluster", "default"]
_LOCATION = ("coordinator", "redis_url")
_FILLED = ("coordinator", "redis_url", "cluster")


@dataclass(frozen=True)
class Resolved:
    """Settings for a CLI command, the local cluster they came from, and each field's origin."""

    settings: CommonSettings
    local: LocalCluster | None
    origin: dict[str, Origin]

    def where(self) -> str:
        """One phrase naming the cluster looked at and why it was that one."""
        s = self.settings
        from_ = {
            "option": "the command's options",
            "environment": "ASTEROID_* variables",
            "local cluster": "the cluster `asteroid up` runs on this machine",
            "default": "the defaults (no cluster found)",
        }[self.origin["redis_url"]]
        return f"cluster {s.cluster!r} at Redis {mask_url(s.redis_url)}, from {from_}"


def resolve(
    coordinator: str | None = None,
    redis_url: str | None = None,
    cluster: str | None = None,
    state_dir: Path | None = None,
) -> Resolved:
    """Settings with explicit options > ASTEROID_* variables > the local cluster > defaults.

    The local cluster fills only the fields nothing else set, and only when what
    was set agrees with it: a coordinator or Redis named elsewhere is another
    cluster, and half of one mixed with half of the local one would submit to
    one and read the other. A CURVE key set (ASTEROID_KEYS) also means another
    cluster: the local one does not use keys.
    """
    given: dict[str, Any] = {
        k: v
        for k, v in (("coordinator", coordinator), ("redis_url", redis_url), ("cluster", cluster))
        if v
    }
    s = CommonSettings(**given)
    chosen = set(s.model_fields_set)
    origin: dict[str, Origin] = {
        f: "option" if f in given else "environment" if f in chosen else "default" for f in _FILLED
    }
    local = None if "keys" in chosen else find_local_cluster(state_dir)
    if local is None or any(f in chosen and getattr(s, f) != getattr(local, f) for f in _LOCATION):
        return Resolved(s, None, origin)
    fill: dict[str, Any] = {f: getattr(local, f) for f in _FILLED if f not in chosen}
    origin.update(dict.fromkeys(fill, "local cluster"))
    return Resolved(CommonSettings(**given, **fill) if fill else s, local, origin)


def resolve_settings(
    coordinator: str | None = None, redis_url: str | None = None, cluster: str | None = None
) -> CommonSettings:
    """`resolve`'s settings: what every CLI command that talks to a cluster uses."""
    return resolve(coordinator, redis_url, cluster).settings
