"""CURVE keys of a cluster and the ZAP authenticator that admits only them.

A cluster's key set is one directory (made by `asteroid keys init DIR`) with a
folder per role::

    DIR/coordinator/coordinator.key(_secret)   the control plane's server pair
    DIR/workers/NAME.key(_secret)              one pair per worker device
    DIR/services/NAME.key(_secret)             planner, profilers
    DIR/operators/NAME.key(_secret)            people using the CLI

Scheme: every device gets the public files of the whole set plus its own
secret file. The coordinator's ROUTER is a CURVE server with the coordinator
pair; every DEALER connecting to it is a CURVE client with its own pair. A
worker's data-plane ROUTER is a CURVE server with that worker's own pair, and
a peer sending to worker NAME uses DIR/workers/NAME.key as the server key, so
no secret is shared between devices.

A bound server runs a ZAP handler that looks the client's public key up in the
public files on every handshake: deleting NAME.key revokes that key without a
restart. An admitted key's User-Id is "ROLE:NAME" (e.g. "worker:jetson-1"),
which `common.codec.recv_message` checks against the routing identity, so a
peer is known by its key, not by the name it claims.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.errors import ConfigError

__all__ = [
    "COORDINATOR",
    "FOLDERS",
    "NAME_PATTERN",
    "CurveKeys",
    "create_key_set",
    "is_loopback",
    "load_keys",
    "service_keys",
    "start_authenticator",
    "stop_authenticator",
]

COORDINATOR = "coordinator"
FOLDERS = {
    "coordinator": "coordinator",
    "worker": "workers",
    "service": "services",
    "operator": "operators",
}
"""Role name to the folder holding its keys."""

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""Key names: file names and routing identities, so no separators or colons."""


def _check_name(name: str, role: str) -> str:
    """`name` if it may name a key file and a routing identity, else ConfigError."""
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"{role} key name {name!r} must match {NAME_PATTERN.pattern} "
            "(letters, digits, '_', '.', '-'; it becomes a file name and a routing identity)"
        )
    return name


def create_key_set(
    root: Path,
    workers: Iterable[str] = (),
    services: Iterable[str] = (),
    operators: Iterable[str] = (),
) -> list[Path]:
    """Create the coordinator pair (once) and a pair per named worker, service, operator.

    Existing pairs are kept, so adding a device later never changes the keys
    of the others. Secret files are made readable by their owner only.
    Returns the secret files created.
    """
    wanted = [("coordinator", COORDINATOR)]
    for role, names in (("worker", workers), ("service", services), ("operator", operators)):
        wanted += [(role, _check_name(n, role)) for n in names]
    seen: dict[str, str] = {}
    for role, name in wanted:
        if seen.setdefault(name, role) != role:
            raise ConfigError(f"key name {name!r} is given as both {seen[name]} and {role}")
    made: list[Path] = []
    for role, name in wanted:
        folder = root / FOLDERS[role]
        folder.mkdir(parents=True, exist_ok=True)
        for other in FOLDERS.values():
            if other != FOLDERS[role] and (root / other / f"{name}.key").exists():
                raise ConfigError(f"key name {name!r} already exists in {root / other}")
        if (folder / f"{name}.key").exists():
            continue
        _, secret = zmq.auth.create_certificates(str(folder), name)
        os.chmod(secret, 0o600)
        made.append(Path(secret))
    return made


@dataclass(frozen=True)
class CurveKeys:
    """A process's own key pair and the cluster's key directory.

    Attributes:
        root: The key set's directory.
        role: This process's role (coordinator, worker, service, operator).
        name: Its key's name, which is also its routing identity.
        public: Its public key (Z85).
        secret: Its secret key (Z85); never logged.

    """

    root: Path
    role: str
    name: str
    public: bytes
    secret: bytes

    def __repr__(self) -> str:
        """Everything but the secret key, for logs and errors."""
        return f"CurveKeys(root={str(self.root)!r}, role={self.role!r}, name={self.name!r})"

    @classmethod
    def load(cls, root: Path, role: str, name: str | None = None) -> CurveKeys:
        """Load this process's pair from `root`.

        Without `name`, the role folder must hold exactly one secret file (a
        device or an operator's machine gets only its own).
        """
        if role not in FOLDERS:
            raise ConfigError(f"unknown key role {role!r}, expected one of {sorted(FOLDERS)}")
        folder = Path(root) / FOLDERS[role]
        if name is None:
            found = sorted(folder.glob("*.key_secret"))
            if len(found) != 1:
                raise ConfigError(
                    f"expected exactly one {role} secret key in {folder}, found {len(found)} "
                    f"(make one with `asteroid keys init {root} --{role} NAME`)"
                )
            name = found[0].name.removesuffix(".key_secret")
        path = folder / f"{_check_name(name, role)}.key_secret"
        if not path.is_file():
            raise ConfigError(
                f"no {role} secret key {path} (make it with `asteroid keys init "
                f"{root} --{role} {name}`)"
                if role != "coordinator"
                else f"no coordinator secret key {path} (make it with `asteroid keys init {root}`)"
            )
        public, secret = zmq.auth.load_certificate(str(path))
        if secret is None:
            raise ConfigError(f"{path} holds no secret key")
        return cls(Path(root), role, name, public, secret)

    def server_key(self, role: str, name: str) -> bytes:
        """The public key of server `name` of `role` (what a DEALER connecting to it needs)."""
        path = self.root / FOLDERS[role] / f"{_check_name(name, role)}.key"
        if not path.is_file():
            raise ConfigError(f"no public key {path} for {role} {name!r} in the key set")
        public, _ = zmq.auth.load_certificate(str(path))
        return public

    def lookup(self, client_key: bytes, roles: Iterable[str]) -> str | None:
        """'ROLE:NAME' of the public key `client_key` (Z85) among `roles`, else None.

        Reads the folders each time, so a deleted key file is refused at once.
        """
        for role in roles:
            for path in sorted((self.root / FOLDERS[role]).glob("*.key")):
                try:
                    public, _ = zmq.auth.load_certificate(str(path))
                except (OSError, ValueError):
                    continue  # a file being rewritten or a stray file admits nobody
                if public == client_key:
                    return f"{role}:{path.name.removesuffix('.key')}"
        return None


def load_keys(root: Path | None, role: str, name: str | None = None) -> CurveKeys | None:
    """`CurveKeys.load(root, role, name)`, or None when no key directory is set."""
    return None if root is None else CurveKeys.load(root, role, name)


def is_loopback(addr: str) -> bool:
    """True when ZeroMQ endpoint `addr` is reachable from this machine only.

    ipc:// and inproc:// never leave it; tcp:// on 127.x, ::1 or localhost
    neither. Anything else, including *, 0.0.0.0 and a host name, is the
    network.
    """
    transport, _, rest = addr.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


AUTH_STOP_S = 5.0
"""How long closing the last CURVE server waits for the ZAP handler's thread."""


class _Authenticator(ThreadAuthenticator):
    """ZAP handler of one context: a domain per server socket, each with its roles."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        super().__init__(ctx)
        self.keys = keys
        self.domains: dict[str, tuple[str, ...]] = {}
        self.users = 0
        self._pending: dict[bytes, str] = {}

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        """Admit a key of the set in one of the domain's roles; remember its User-Id."""
        roles = self.domains.get(domain)
        if roles is None:
            return False, b"Unknown domain"
        user = self.keys.lookup(z85.encode(client_key), roles)
        if user is None:
            self.log.warning("refused CURVE key %s on %s", z85.encode(client_key), domain)
            return False, b"Unknown key"
        self._pending[client_key] = user
        return True, b"OK"

    def curve_user_id(self, client_public_key: bytes) -> str:
        """'ROLE:NAME' found for this key by the check just made."""
        return self._pending.pop(client_public_key, "")

    def stop(self, timeout_s: float = AUTH_STOP_S) -> None:
        """Stop the handler's thread, waiting at most `timeout_s` for it.

        pyzmq's own `stop` joins without a bound, and it runs in whichever
        thread closes the last server socket: a handler that does not answer
        would hang that thread's shutdown, and with it the service's. One
        that overstays is left to the process's exit (it is a daemon thread),
        its sockets untouched, since closing them under it is undefined.
        """
        if self.pipe is None or self.thread is None:
            return
        self.pipe.send(b"TERMINATE")
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.log.warning("the ZAP handler did not stop within %.0f s; left running", timeout_s)
            return
        self.thread = None  # type: ignore[assignment]
        self.pipe.close()
        self.pipe = None  # type: ignore[assignment]
        # the base Authenticator's stop: close the ZAP socket (the thread's is done)
        super(ThreadAuthenticator, self).stop()


_lock = threading.Lock()
_authenticators: dict[int, tuple[weakref.ref[zmq.Context[Any]], _Authenticator]] = {}
"""ZAP handlers by context id; the weak reference tells a reused id from the same context."""


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys, roles: Iterable[str]) -> str:
    """Make sure `ctx` runs the ZAP handler; returns the ZAP domain admitting `roles`.

    ZeroMQ asks one handler per context, so server sockets of one context
    share it and differ by domain.
    """
    domain = ",".join(sorted(roles))
    with _lock:
        ref, auth = _authenticators.get(id(ctx), (None, None))
        if auth is None or ref is None or ref() is not ctx:
            auth = _Authenticator(ctx, keys)
            auth.start()
            _authenticators[id(ctx)] = (weakref.ref(ctx), auth)
        auth.domains[domain] = tuple(sorted(roles))
        auth.users += 1
    return domain


def stop_authenticator(ctx: zmq.Context[Any]) -> None:
    """Release one server socket's use of `ctx`'s ZAP handler; stop it after the last.

    The handler's own sockets would otherwise keep `ctx.term()` waiting.
    """
    with _lock:
        ref, auth = _authenticators.get(id(ctx), (None, None))
        if auth is None or ref is None or ref() is not ctx:
            return
        auth.users -= 1
        if auth.users > 0:
            return
        del _authenticators[id(ctx)]
    auth.stop()


def service_keys(
    root: Path | None, name: str | None = None
) -> tuple[CurveKeys | None, bytes | None]:
    """A service's pair and the coordinator's public key from `root`; (None, None) without.

    `name` picks the service's pair (None: the folder's only one). Every failure
    is a ConfigError that names the file and how to make it, so a service exits
    with one line instead of a traceback.
    """
    try:
        keys = load_keys(root, "service", name)  # its error names the file and the command
        if keys is None:
            return None, None
        try:
            return keys, keys.server_key("coordinator", COORDINATOR)
        except ConfigError as exc:
            # made with the set by `asteroid keys init`; a new one here would not match
            raise ConfigError(
                f"{exc} (copy it from the key set `asteroid keys init` made: every device "
                "needs the set's public files)"
            ) from exc
    except (OSError, ValueError) as exc:  # an unreadable directory or file, a corrupt key
        raise ConfigError(
            f"cannot read the CURVE key set {root}: {exc} (it must be a readable directory "
            f"made by `asteroid keys init {root} --service {name or 'NAME'}`)"
        ) from exc
