"""The Redis store: one key schema, chunked blobs, streams.

Every key starts with `asteroid:<cluster>:` so several clusters (and test
runs) share one Redis. Large blobs are written chunk by chunk and published by
writing their manifest last, so a reader never sees half a blob. Redis is
never on the per-micro-batch path: only registration, plans, round commits,
metrics and checkpoints go through here.

Durability: a write Redis acknowledges is in its memory and, with an
append-only file, handed to the OS. `Store.wait_durable` then waits until it
is fsynced (WAITAOF, Redis 7.2 or newer). A server without WAITAOF gives what
its `appendfsync` gives: with `everysec` a power cut can lose up to about a
second of acknowledged writes, with `always` none. A killed redis-server loses
nothing it has written to the file (the OS holds it), but with `everysec` it
may answer a write and hold it back for up to two seconds while a slow fsync
runs: a SIGKILL in that window loses it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import redis

from common.errors import (
    ConfigError,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    unreachable_for,
)
from common.logging import get_logger
from common.secrets import mask_text, mask_url, remember_url

__all__ = ["OUTAGE", "REFUSED", "Store"]

log = get_logger(__name__)
T = TypeVar("T")
OUTAGE = (redis.ConnectionError, redis.TimeoutError)
"""What Redis raises while it is away (refused, reset, loading, timed out): worth waiting out.

Other Redis errors (a wrong type, a refused command) are bugs or misconfiguration
and are raised at once.
"""
REFUSED = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    redis.exceptions.ExecAbortError,
)
"""What Redis answers when it is there but will not do a command: full (OutOfMemoryError
under `maxmemory-policy noeviction`), a read-only replica (ReadOnlyError), an ACL denial,
a transaction it refused to queue (ExecAbortError).

Waiting does not help, so `Store.ride_out` turns it into StoreRefused at once; any other
answer (a wrong type) is a bug, raised as it is.
"""

CHUNK_BYTES = 4 << 20
_GLOB = re.compile(r"([*?\[\]\\])")
"""Characters SCAN MATCH treats as a pattern; escaped with a backslash."""


class Store:
    """Typed access to the cluster's shared state."""

    def __init__(
        self, url: str, cluster: str, timeout_s: float = 30.0, connect_timeout_s: float = 5.0
    ) -> None:
        """Connect lazily to `url`; `timeout_s` bounds each command, `connect_timeout_s` a connect.

        The defaults outlast a loaded Redis; a check that must finish in seconds
        (`asteroid doctor`) passes shorter ones.
        """
        self.prefix = f"asteroid:{cluster}:"
        remember_url(url)  # hidden from now on wherever this process shows text
        self.where = mask_url(url)
        """The Redis URL with its password hidden: what errors and logs may show."""
        try:
            self.r = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s
            )
        except ValueError:
            # redis-py's message quotes the piece it choked on, a piece of the password
            raise ConfigError(
                f"cannot read the Redis URL {self.where}: a password holding '@', ':', '/', "
                "'?', '#', '%' or spaces must be percent-encoded (or put in "
                "--redis-password-file)"
            ) from None
        self._waitaof: bool | None = None
        """Whether WAITAOF works here; None until the first `wait_durable` finds out."""

    def ride_out(
        self,
        op: Callable[[], T],
        what: str,
        patience_s: float,
        idle: Callable[[float], object] = time.sleep,
    ) -> T:
        """`op()`, retried with backoff while Redis is away, for up to `patience_s`.

        A service that needs Redis for its next step waits for it instead of
        dying: `idle(seconds)` runs between attempts (the coordinator keeps
        answering its socket there). Raises StoreUnavailable, naming `what` was
        waiting and for how long, once the outage outlasts `patience_s`; and
        StoreRefused at once when Redis refuses a command (see REFUSED).
        """
        delay, began = 0.1, None
        while True:
            try:
                result = op()
            except REFUSED as exc:
                raise self.refusal(exc, what) from exc
            except OUTAGE as exc:
                now = time.monotonic()
                if began is None:
                    began = now
                    log.warning(
                        "Redis unreachable; waiting for it",
                        redis=self.where,
                        waiting=what,
                        patience_s=patience_s,
                        error=mask_text(str(exc)),
                    )
                if now - began >= patience_s:
                    error = mask_text(str(exc))
                    why = unreachable_for(self.where, now - began, what, patience_s, error)
                    raise StoreUnavailable(why) from exc
                idle(min(delay, max(0.0, began + patience_s - now)))
                delay = min(2 * delay, 2.0)
                continue
            if began is not None:
                log.info(
                    "Redis is back",
                    redis=self.where,
                    waited=what,
                    after_s=round(time.monotonic() - began, 2),
                )
            return result

    def refusal(self, exc: redis.RedisError, what: str) -> StoreRefused:
        """StoreRefused naming this Redis, what was being done and Redis's own reason.

        A pipeline's error quotes its command, a blob's bytes included: only the
        reason Redis gave is kept.
        """
        reason = mask_text(str(exc).rpartition(" of pipeline caused error: ")[2])
        kind = type(exc).__name__  # OutOfMemoryError, ReadOnlyError: Redis's reply drops its code
        return StoreRefused(
            f"Redis at {self.where} refused a command while {what}: {kind}: {reason}"
        )

    def key(self, *parts: object) -> str:
        """The full key for `parts` under this cluster's prefix."""
        return self.prefix + ":".join(str(p) for p in parts)

    def ping(self) -> None:
        """Fail fast, with the URL (its password hidden), when Redis does not answer."""
        try:
            self.r.ping()
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"Redis at {self.where} does not answer: {mask_text(str(exc))}"
            ) from exc

    def probe(self) -> None:
        """PING, raising the client's own error: a step that only needs Redis there rides it out.

        Unlike `ping`, an outage stays an OUTAGE error, so `ride_out` waits for it.
        """
        self.r.ping()

    def server_time(self) -> float:
        """Redis's clock (TIME), seconds since the epoch: a reference to compare this host's with.

        Raises the client's error (a denied TIME is NoPermissionError) as it is.
        """
        seconds, micros = self.r.time()
        return seconds + micros / 1e6

    def wait_durable(self, timeout_s: float = 1.0) -> bool:
        """Wait up to `timeout_s` until Redis has fsynced this connection's writes to its AOF.

        True once they are on disk. False, without an error, when they may not
        be yet: the wait timed out, or WAITAOF is unavailable (Redis older than
        7.2, `appendonly no`, or an ACL user without `+waitaof`). Unavailability
        is found by trying the command once, since the roles' ACL users may run
        neither COMMAND nor INFO, and is remembered for this Store. Without
        WAITAOF a commit is as durable as the server's `appendfsync` makes it
        (see the module docstring). Outages raise as everywhere (see OUTAGE).
        """
        if self._waitaof is False:
            return False
        try:
            wait_ms = max(1, round(timeout_s * 1000))  # 0 would mean: wait forever
            reply = self.r.execute_command("WAITAOF", 1, 0, wait_ms)  # type: ignore[no-untyped-call]
        except redis.ResponseError as exc:
            self._waitaof = False
            log.warning(
                "Redis cannot wait for its append-only file; commits are as durable as "
                "its appendfsync setting makes them",
                redis=self.where,
                error=mask_text(str(exc)),
            )
            return False
        self._waitaof = True
        return _fsynced_locally(reply)

    # --- JSON documents -------------------------------------------------------

    def put_json(self, value: Any, *parts: object) -> None:
        """Store a JSON document."""
        self.r.set(self.key(*parts), json.dumps(value))

    def get_json(self, *parts: object) -> Any:
        """A JSON document, or None when absent."""
        raw = self.r.get(self.key(*parts))
        return None if raw is None else json.loads(raw)

    def put_jsons(self, docs: Iterable[tuple[tuple[object, ...], Any]]) -> None:
        """Store several JSON documents, each `(parts, value)`, in one MULTI/EXEC.

        A reader sees all of them or none: a checkpoint's manifest and the
        `latest` pointer to it are published together.
        """
        pipe = self.r.pipeline(transaction=True)
        for parts, value in docs:
            pipe.set(self.key(*parts), json.dumps(value))
        pipe.execute()

    # --- counters and exact keys ----------------------------------------------

    def incr(self, *parts: object) -> int:
        """Add one to a counter (0 when absent) and return its new value."""
        return int(self.r.incr(self.key(*parts)))

    def increment_field(self, field: str, *parts: object, by: int = 1) -> int:
        """Add `by` to an integer field of a hash and return its new value."""
        return int(self.r.hincrby(self.key(*parts), field, by))

    def delete(self, *names: str | bytes) -> int:
        """Delete the exact keys `names` (from `key` or `keys`, never a pattern); how many went."""
        return int(self.r.delete(*names)) if names else 0

    # --- sorted sets ----------------------------------------------------------

    def add_ranked(self, member: str, score: float, *parts: object) -> None:
        """Add `member` to a sorted set with `score` (or move it there)."""
        self.r.zadd(self.key(*parts), {member: score})

    def top_ranked(self, count: int, *parts: object) -> list[str]:
        """Up to `count` members of a sorted set, highest score first."""
        raw = cast(list[bytes], self.r.zrevrange(self.key(*parts), 0, max(0, count - 1)))
        return [m.decode() for m in raw] if count > 0 else []

    # --- chunked blobs --------------------------------------------------------

    def put_blob(self, data: bytes, *parts: object) -> None:
        """Write `data` in chunks, then its manifest (which makes it visible)."""
        base = self.key(*parts)
        view = memoryview(data)
        n = max(1, -(-len(data) // CHUNK_BYTES))
        pipe = self.r.pipeline(transaction=False)
        for i in range(n):
            pipe.set(f"{base}:chunk:{i}", bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]))
        digest = hashlib.sha256(data).hexdigest()
        pipe.set(
            f"{base}:manifest", json.dumps({"chunks": n, "bytes": len(data), "sha256": digest})
        )
        pipe.execute()

    def blob_manifest(self, *parts: object) -> dict[str, Any] | None:
        """A blob's manifest (`chunks`, `bytes`, and `sha256` if its writer recorded it)."""
        manifest = self.get_json(*parts, "manifest")
        return None if manifest is None else dict(manifest)

    def get_blob(self, *parts: object) -> bytes | None:
        """A blob, or None when its manifest is absent.

        Raises StoreError if chunks are missing or the bytes do not hash to the
        manifest's sha256 (a chunk overwritten or damaged after the blob was written).
        """
        base = self.key(*parts)
        raw = self.r.get(f"{base}:manifest")
        if raw is None:
            return None
        manifest = json.loads(raw)
        names = [f"{base}:chunk:{i}" for i in range(manifest["chunks"])]
        chunks = cast(list[bytes | None], self.r.mget(names))
        if any(c is None for c in chunks):
            raise StoreError(f"blob {base} is missing chunks")
        data = b"".join(c for c in chunks if c is not None)
        if len(data) != manifest["bytes"]:
            raise StoreError(
                f"blob {base} has {len(data)} bytes, manifest says {manifest['bytes']}"
            )
        expected = manifest.get("sha256")
        if expected is not None and (actual := hashlib.sha256(data).hexdigest()) != expected:
            raise StoreError(f"blob {base} hashes to sha256 {actual}, manifest says {expected}")
        return data

    def _under(self, *parts: object) -> Iterator[bytes]:
        """Keys that start with ``key(*parts)``, compared byte for byte.

        The prefix holds ids that came from outside (job ids, device names), so it is
        never handed to Redis as a pattern as it is: its glob characters are escaped
        for SCAN MATCH, and every key is checked against the literal prefix again.
        """
        prefix = self.key(*parts)
        literal = prefix.encode()
        match = _GLOB.sub(r"\\\1", prefix) + "*"
        for key in self.r.scan_iter(match=match, count=1000):
            if key.startswith(literal):
                yield key

    def delete_prefix(self, *parts: object) -> int:
        """Delete every key whose name starts with ``key(*parts)`` (not a pattern)."""
        keys = list(self._under(*parts))
        return int(self.r.delete(*keys)) if keys else 0

    # --- streams --------------------------------------------------------------

    def append(self, stream: str, job: str, fields: dict[str, Any], maxlen: int = 10000) -> None:
        """Append one entry (values JSON-encoded) to a capped stream."""
        self.r.xadd(
            self.key(stream, job),
            {k: json.dumps(v) for k, v in fields.items()},
            maxlen=maxlen,
            approximate=True,
        )

    def read(self, stream: str, job: str) -> list[dict[str, Any]]:
        """Every entry of a stream, decoded, oldest first."""
        out = []
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.r.xrange(self.key(stream, job)))
        for _, fields in entries:
            out.append({k.decode(): json.loads(v) for k, v in fields.items()})
        return out

    def read_entries(self, stream: str, job: str) -> list[tuple[str, dict[str, Any]]]:
        """Every entry of a stream with its id (``<ms>-<seq>``, Redis's clock), oldest first."""
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.r.xrange(self.key(stream, job)))
        return [
            (entry_id.decode(), {k.decode(): json.loads(v) for k, v in fields.items()})
            for entry_id, fields in entries
        ]

    def read_after(self, stream: str, job: str, after: str) -> tuple[list[dict[str, Any]], str]:
        """Entries newer than id `after` ("0" for all) and the id of the newest one read."""
        raw = self.r.xrange(self.key(stream, job), min=f"({after}" if after != "0" else "-")
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], raw)
        out = [{k.decode(): json.loads(v) for k, v in fields.items()} for _, fields in entries]
        return out, (entries[-1][0].decode() if entries else after)

    def update_job(
        self, job: str, fields: dict[str, Any], entries: dict[str, tuple[dict[str, Any], int]]
    ) -> None:
        """Set fields of the job's hash and append to its streams in one MULTI/EXEC.

        `entries` maps a stream name to (entry, maxlen). A round is committed by its
        hash's `round` and its metrics entry together: a writer killed between two
        separate writes would leave a round counted with no metrics, or the reverse.
        """
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key("job", job), mapping={k: json.dumps(v) for k, v in fields.items()})
        for stream, (entry, maxlen) in entries.items():
            pipe.xadd(
                self.key(stream, job),
                {k: json.dumps(v) for k, v in entry.items()},
                maxlen=maxlen,
                approximate=True,
            )
        pipe.execute()

    def set_fields(
        self, mapping: dict[str, Any], *parts: object, ttl_s: float | None = None
    ) -> None:
        """Set fields of a hash (values JSON-encoded); with `ttl_s`, the hash expires then.

        A record about a peer (a device's last heartbeat) takes a TTL, renewed by
        each write, so it cannot outlive whoever keeps it fresh: a coordinator that
        exits, or a peer that only pretended to be a device.
        """
        key = self.key(*parts)
        if ttl_s is None:
            self.r.hset(key, mapping={k: json.dumps(v) for k, v in mapping.items()})
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in mapping.items()})
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        pipe.execute()

    def get_fields(self, *parts: object) -> dict[str, Any]:
        """All fields of a hash, decoded."""
        raw = cast(dict[bytes, bytes], self.r.hgetall(self.key(*parts)))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def close(self) -> None:
        """Release the connection pool."""
        self.r.close()

    def keys(self, *parts: object) -> Iterable[bytes]:
        """Keys whose name starts with ``key(*parts)`` (for status and tests; not a pattern)."""
        return self._under(*parts)


def _fsynced_locally(reply: object) -> bool:
    """Whether a WAITAOF reply ``[local, replicas]`` says the local AOF holds the writes."""
    if not isinstance(reply, (list, tuple)) or not reply:
        raise StoreError(f"WAITAOF answered {reply!r}, expected [local, replicas]")
    return int(reply[0]) >= 1
