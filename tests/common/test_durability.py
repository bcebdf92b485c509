"""Checkpoints survive a SIGKILLed Redis, crashed uploads leave no debris, damage is caught.

Each test runs its own redis-server with an append-only file in a temporary
directory (the embedded Redis of `asteroid up`, with a state directory), kills it
with SIGKILL right after Redis acknowledged a commit (and wrote it to its file:
`AofRedis.wait_written`) and starts a new one on the same directory: what it loads
from the AOF is what a restarted deployment would see.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
import torch
from torch import nn

from common import store as store_mod
from common.checkpoint import (
    commit_checkpoint,
    latest_round,
    load_full_state,
    load_stage,
    remove_orphans,
    restore_optimizer,
    save_stage,
    stage_blobs,
)
from common.embedded_redis import EmbeddedRedis
from common.errors import CheckpointError
from common.store import Store

JOB = "durable-job"
CLUSTER = "durability"
LAYERS = 5
CHUNK = 256
ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "redis-acl.conf"
"""Small chunks, so every layer blob spans several Redis values."""


class AofRedis:
    """A redis-server persisting to one directory, which can be SIGKILLed and started again.

    A restart comes back on the port of the first start, as a deployed Redis does,
    so clients that ride out the outage find it again.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.port = 0
        self.server: EmbeddedRedis | None = None
        self.store: Store | None = None

    def start(self) -> Store:
        self.server = EmbeddedRedis(port=self.port, state_dir=self.state_dir).__enter__()
        self.port = self.server.port
        self.store = Store(self.server.url, CLUSTER)
        return self.store

    def wait_written(self, timeout_s: float = 10.0) -> None:
        """Wait until everything Redis acknowledged so far is written to its AOF file.

        With `appendfsync everysec` Redis may answer a write and hold it in its
        AOF buffer for up to two seconds while a background fsync is running
        (a busy disk); a SIGKILL then loses it. An empty buffer at one INFO means
        every command executed before it has reached the file (the OS keeps it
        across the kill). Redis 7.2's WAITAOF says more, per connection.
        """
        assert self.server is not None, "the redis-server is not running"
        client = redis.Redis.from_url(self.server.url)
        deadline = time.monotonic() + timeout_s
        try:
            while int(client.info("persistence")["aof_buffer_length"]) > 0:
                assert time.monotonic() < deadline, f"AOF buffer not written in {timeout_s} s"
                time.sleep(0.01)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync; only what reached the AOF file survives."""
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.server is not None and self.server.proc is not None:
            self.server.proc.kill()
            self.server.proc.wait(timeout=10)
            self.server = None

    def restart(self) -> Store:
        """SIGKILL once what Redis acknowledged is in its file; start again on the same port."""
        self.wait_written()
        self.kill()
        return self.start()


@pytest.fixture
def aof(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AofRedis]:
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", CHUNK)
    server = AofRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
    )


def _steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> None:
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()


def _trained() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, 0, 3)
    return model, opt


def _raw_keys(store: Store, round_no: int) -> set[bytes]:
    """Every key of one checkpoint round, listed straight from Redis."""
    return set(cast(list[bytes], store.r.keys(f"asteroid:{CLUSTER}:ckpt:{JOB}:{round_no}:*")))


def test_a_checkpoint_acknowledged_before_a_sigkill_is_resumed_from_exactly(aof: AofRedis) -> None:
    model, opt = _trained()
    store = aof.store
    assert store is not None
    save_stage(store, JOB, 4, model, opt, 0)
    commit_checkpoint(store, JOB, 4, LAYERS)
    expected_hashes = {
        str(i): hashlib.sha256(b).hexdigest() for i, b in stage_blobs(model, opt, 0).items()
    }

    store = aof.restart()  # SIGKILL right after the commit was acknowledged

    assert latest_round(store, JOB) == 4
    assert store.get_json("ckpt", JOB, 4, "manifest")["sha256"] == expected_hashes
    full = load_full_state(store, JOB, 4)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    resumed = _model()
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    weights, optim = load_stage(store, JOB, 4, 0, LAYERS)
    resumed.load_state_dict(weights)
    restore_optimizer(resumed, resumed_opt, optim)
    _steps(model, opt, 3, 2)
    _steps(resumed, resumed_opt, 3, 2)
    for name, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_crash_mid_upload_leaves_the_previous_checkpoint_and_its_debris_is_removed(
    aof: AofRedis,
) -> None:
    model, opt = _trained()
    store = aof.store
    assert store is not None
    save_stage(store, JOB, 2, model, opt, 0)
    commit_checkpoint(store, JOB, 2, LAYERS)
    committed = stage_blobs(model, opt, 0)
    _steps(model, opt, 3, 1)
    blobs = stage_blobs(model, opt, 0)
    for layer in (0, 2):  # the upload of round 3 dies after two of five layers
        store.put_blob(blobs[layer], "ckpt", JOB, 3, "layer", layer)
    store.r.set(store.key("ckpt", JOB, 3, "layer", 4, "chunk", 0), b"half a blob")

    store = aof.restart()

    assert latest_round(store, JOB) == 2
    kept = _raw_keys(store, 2)
    assert len(kept) == 1 + LAYERS + sum(math.ceil(len(b) / CHUNK) for b in committed.values())
    load_full_state(store, JOB, 2)  # complete and hash-verified
    debris = 2 + math.ceil(len(blobs[0]) / CHUNK) + math.ceil(len(blobs[2]) / CHUNK) + 1
    assert len(_raw_keys(store, 3)) == debris
    assert remove_orphans(store, JOB) == 0  # newer than the latest: may still be uploading
    assert remove_orphans(store, JOB, newer_too=True) == debris
    assert _raw_keys(store, 3) == set()
    assert _raw_keys(store, 2) == kept
    assert latest_round(store, JOB) == 2


def test_a_corrupted_chunk_is_caught_by_the_hash_after_a_restart(aof: AofRedis) -> None:
    model, opt = _trained()
    store = aof.store
    assert store is not None
    save_stage(store, JOB, 1, model, opt, 0)
    commit_checkpoint(store, JOB, 1, LAYERS)
    chunk = store.key("ckpt", JOB, 1, "layer", 2, "chunk", 1)
    original = store.r.get(chunk)
    assert isinstance(original, bytes)
    store.r.set(chunk, bytes(b ^ 0x01 for b in original))  # same length, other bytes

    store = aof.restart()

    with pytest.raises(CheckpointError, match=r"layer 2 is damaged.*sha256"):
        load_full_state(store, JOB, 1)
    with pytest.raises(CheckpointError, match="layer 2 is damaged"):
        load_stage(store, JOB, 1, 2, 3)
    load_stage(store, JOB, 1, 3, LAYERS)  # the other layers still load


def _as_role(aof: AofRedis, role: str) -> Store:
    """A Store logged in as `role`, with exactly the rights `deploy/redis-acl.conf` gives it."""
    assert aof.store is not None and aof.server is not None
    line = next(ln for ln in ACL_FILE.read_text().splitlines() if ln.startswith(f"user {role} "))
    rules = [r for r in line.split()[2:] if not r.startswith("#")]
    aof.store.r.execute_command("ACL", "SETUSER", role, "nopass", *rules)  # type: ignore[no-untyped-call]
    return Store(aof.server.url.replace("redis://", f"redis://{role}:x@"), CLUSTER)


def test_the_roles_acl_users_may_write_commit_clean_up_and_load(aof: AofRedis) -> None:
    model, opt = _trained()
    worker, coordinator = _as_role(aof, "worker"), _as_role(aof, "coordinator")
    try:
        save_stage(worker, JOB, 1, model, opt, 0)
        commit_checkpoint(coordinator, JOB, 1, LAYERS)
        worker.put_blob(b"abandoned", "ckpt", JOB, 2, "layer", 0)
        save_stage(worker, JOB, 3, model, opt, 0)
        commit_checkpoint(coordinator, JOB, 3, LAYERS)  # also removes round 2's two keys
        weights, _ = load_stage(worker, JOB, 3, 0, LAYERS)
    finally:
        worker.close()
        coordinator.close()
    assert _raw_keys(aof.store, 2) == set()  # type: ignore[arg-type]
    assert set(weights) == set(model.state_dict())


def _version(client: redis.Redis) -> tuple[int, ...]:
    info = client.info("server")
    return tuple(int(p) for p in str(info["redis_version"]).split(".")[:2])


def test_wait_durable_answers_without_raising_on_this_server(aof: AofRedis) -> None:
    store = aof.store
    assert store is not None
    store.put_json({"round": 1}, "commit", JOB)
    has_waitaof = _version(store.r) >= (7, 2)
    assert store.wait_durable(0.5) is has_waitaof  # AOF is on: only the version decides
    assert store.wait_durable(0.5) is has_waitaof


def test_wait_durable_is_false_without_an_aof() -> None:
    with EmbeddedRedis() as server:
        store = Store(server.url, CLUSTER)
        try:
            assert store.wait_durable(0.2) is False
        finally:
            store.close()
