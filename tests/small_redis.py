"""A redis-server of a test's own with a small `maxmemory`, as a full Redis behaves.

`noeviction` makes Redis refuse every write that needs memory once it is full
(OutOfMemoryError), while reads and DEL still work: what a deployed Redis does
when checkpoints pile up. No persistence: the test's data dies with it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from common.embedded_redis import redis_server_binary, wait_until_answers
from common.ports import free_port

__all__ = ["small_redis"]


@contextmanager
def small_redis(work: Path, maxmemory: str) -> Iterator[str]:
    """A redis-server on a free port refusing writes past `maxmemory` ("20mb"); its URL.

    The server is killed on the way out, whatever the test did.
    """
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    work.mkdir(parents=True, exist_ok=True)
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(work)]
    args += ["--save", "", "--appendonly", "no"]
    args += ["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]
    with (work / "redis.log").open("ab") as log:
        proc = subprocess.Popen([redis_server_binary(), *args], stdout=log, stderr=log)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            assert wait_until_answers(client, proc, 10), f"redis-server did not start on {port}"
        finally:
            client.close()
        yield url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
