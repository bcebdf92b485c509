#!/usr/bin/python3
"""Entrypoint of the worker and control images: the Redis password from a file, then exec.

A password in a container's environment shows in `docker inspect` and in the
compose file; so the Redis URL is configured without it
(``ASTEROID_REDIS_URL=redis://worker@redis:6379/0``) and the password lies in a
mounted file named by ``ASTEROID_REDIS_PASSWORD_FILE``. This joins the two and
execs the command, which then is PID 1 and gets the container's signals.
Without the variable the command runs unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

MAX_PASSWORD_BYTES = 512
"""Longer than any generated password; a bigger file is the wrong file."""


def _fail(message: str) -> None:
    print(f"asteroid-entrypoint: error: {message}", file=sys.stderr)
    sys.exit(2)


def url_with_password(url: str, password_file: Path) -> str:
    """`url` (a user, no password) with the password read from `password_file` put in."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        _fail(f"ASTEROID_REDIS_URL {url!r} is not redis://USER@HOST:PORT/DB")
    if not parts.username or parts.password is not None:
        _fail("ASTEROID_REDIS_URL must name a user and no password (the password is in a file)")
    try:
        raw = password_file.read_bytes()
    except OSError as exc:
        _fail(f"cannot read ASTEROID_REDIS_PASSWORD_FILE {password_file}: {exc.strerror}")
    password = raw.decode("utf-8", "replace").strip()
    if not password or len(raw) > MAX_PASSWORD_BYTES or "\n" in password:
        _fail(f"{password_file} must hold one password of 1 to {MAX_PASSWORD_BYTES} bytes")
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def main() -> None:
    """Set the full Redis URL if a password file is named, then exec the command."""
    if len(sys.argv) < 2:
        _fail("no command given (e.g. asteroid-worker)")
    password_file = os.environ.pop("ASTEROID_REDIS_PASSWORD_FILE", "")
    if password_file:
        url = os.environ.get("ASTEROID_REDIS_URL", "")
        os.environ["ASTEROID_REDIS_URL"] = url_with_password(url, Path(password_file))
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as exc:
        _fail(f"cannot run {sys.argv[1]}: {exc.strerror}")


if __name__ == "__main__":
    main()
