#!/usr/bin/python3
"""Entrypoint of the Redis image: the cluster's ACL users with their passwords, then Redis.

`deploy/redis-acl.conf` (in the image) names one user per role with a
placeholder for the SHA-256 of its password. The passwords are files mounted
at ``/run/secrets/redis/ROLE.password`` (made next to the CURVE key set by
`deploy/images/compose-keys.sh`); their hashes go into an ACL file only Redis
reads, so no password is in the image, the environment or Redis's own files.
Redis then runs as the `redis` user with `deploy/redis.conf` (append-only
file in the volume at /var/lib/redis).

`--health` is the image's healthcheck instead: AUTH as the read-only operator
and PING, which fails while Redis loads its append-only file or if the users
did not load.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import socket
import sys
from pathlib import Path

SECRETS = Path(os.environ.get("ASTEROID_REDIS_SECRETS", "/run/secrets/redis"))
TEMPLATE = Path("/etc/redis/asteroid-acl.conf")
CONFIG = Path("/etc/redis/asteroid.conf")
USERS = Path("/tmp/asteroid-users.acl")
PORT = 6379
PLACEHOLDER = re.compile(r"#SHA256_OF_([A-Z]+)_PASSWORD\b")
MAX_PASSWORD_BYTES = 512


def _fail(message: str) -> None:
    print(f"asteroid-redis: error: {message}", file=sys.stderr)
    sys.exit(2)


def password(role: str) -> str:
    """The password of `role` from its secret file, checked to be one plausible line."""
    path = SECRETS / f"{role}.password"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror} (deploy/images/compose-keys.sh makes it)")
    text = raw.decode("utf-8", "replace").strip()
    if len(text) < 16 or len(raw) > MAX_PASSWORD_BYTES or any(c.isspace() for c in text):
        _fail(f"{path} must hold one password of 16 to {MAX_PASSWORD_BYTES} bytes, no spaces")
    return text


def acl_users(template: str) -> str:
    """The ACL file as `aclfile` takes it: every hash filled in, comments dropped."""
    text = PLACEHOLDER.sub(
        lambda m: "#" + hashlib.sha256(password(m[1].lower()).encode()).hexdigest(), template
    )
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return "\n".join(lines) + "\n"


def serve() -> None:
    """Write the users for Redis only, drop root, exec redis-server in the foreground."""
    users = acl_users(TEMPLATE.read_text())
    fd = os.open(USERS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(users)
    command = ["redis-server", str(CONFIG), "--aclfile", str(USERS)]
    # every interface of the container's network; the ACL (default user off) guards it
    command += ["--bind", "*", "-::*", "--protected-mode", "no", "--port", str(PORT)]
    command += ["--daemonize", "no", "--logfile", ""]
    if os.geteuid() == 0:
        user = pwd.getpwnam("redis")
        os.chown(USERS, user.pw_uid, user.pw_gid)
        command = ["setpriv", "--reuid=redis", "--regid=redis", "--init-groups", "--", *command]
    os.execvp(command[0], command)


def _resp(*args: str) -> bytes:
    return b"".join(
        [f"*{len(args)}\r\n".encode()]
        + [f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args]
    )


def health() -> None:
    """Exit 0 if Redis answers PING for the operator user, else 1 with the reason."""
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=3.0) as sock:
            sock.sendall(_resp("AUTH", "operator", password("operator")) + _resp("PING"))
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        print(f"asteroid-redis: no answer on port {PORT}: {exc}", file=sys.stderr)
        sys.exit(1)
    if reply != b"+OK\r\n+PONG\r\n":
        print(f"asteroid-redis: unexpected reply {reply[:200]!r}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--health"]:
        health()
    else:
        serve()
