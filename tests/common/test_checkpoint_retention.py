"""Checkpoint retention and a Redis that refuses writes, on real redis-servers.

Retention keeps the newest `keep` committed checkpoints (and always the one
`latest` names) and deletes the others whole. A full Redis (a small `maxmemory`,
`noeviction`) refuses a checkpoint write: `Store.ride_out` turns the refusal
into StoreRefused naming Redis and its reason, and a refused commit leaves
neither a manifest nor a moved `latest`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from torch import nn

from common import store as store_mod
from common.checkpoint import (
    commit_checkpoint,
    committed_rounds,
    latest_round,
    load_full_state,
    prune_checkpoints,
    save_stage,
)
from common.errors import StoreRefused
from common.store import Store
from tests.small_redis import small_redis


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _checkpoint(store: Store, job: str, round_no: int, model: nn.Sequential) -> None:
    save_stage(store, job, round_no, model, None, 0)
    commit_checkpoint(store, job, round_no, len(model))


def _round_keys(store: Store, job: str, round_no: int) -> list[bytes]:
    return list(store.keys("ckpt", job, round_no, ""))


def _fill(store: Store) -> None:
    """Make Redis full: its data already exceeds a `maxmemory` lowered below it."""
    store.r.config_set("maxmemory", "0")
    store.r.set(store.key("filler"), bytes(2 << 20))
    store.r.config_set("maxmemory", "1mb")


def test_pruning_keeps_the_newest_and_deletes_the_rest_whole(store):
    model = _model()
    for r in range(5):
        _checkpoint(store, "j", r, model)
    save_stage(store, "j", 5, model, None, 0)  # an upload in flight: not committed
    assert prune_checkpoints(store, "j", 2) == [0, 1, 2]
    assert committed_rounds(store, "j") == [3, 4]
    for r in (0, 1, 2):
        assert _round_keys(store, "j", r) == [], r  # layers and manifest alike
    assert _round_keys(store, "j", 5)  # the upload in flight is left alone
    assert latest_round(store, "j") == 4
    torch.testing.assert_close(
        load_full_state(store, "j", 4), {f"{k}": v for k, v in model.state_dict().items()}
    )
    assert prune_checkpoints(store, "j", 2) == []  # nothing more to do


def test_the_checkpoint_latest_names_stays_even_when_older(store):
    model = _model()
    for r in (4, 6, 8):
        _checkpoint(store, "j", r, model)
    _checkpoint(store, "j", 5, model)  # a heavy recovery commits an older version last
    assert latest_round(store, "j") == 5
    assert prune_checkpoints(store, "j", 1) == [4, 6]
    assert committed_rounds(store, "j") == [5, 8]


def test_keep_below_one_is_refused(store):
    with pytest.raises(ValueError, match="at least 1"):
        prune_checkpoints(store, "j", 0)


def test_a_full_redis_refuses_a_checkpoint_by_name_and_commits_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 1 << 20)
    big = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 4 MiB a layer
    with small_redis(tmp_path / "redis", "6mb") as url:
        store = Store(url, "full")
        try:
            with pytest.raises(StoreRefused) as refused:
                store.ride_out(
                    lambda: save_stage(store, "j", 3, big, None, 0),
                    "saving the checkpoint of stage 0 round 3",
                    patience_s=5,
                )
            text = str(refused.value)
            assert text.startswith(f"Redis at {url} refused a command while saving the"), text
            assert "OutOfMemoryError" in text and "maxmemory" in text, text
            assert len(text) < 400, text  # the pipeline's command (a chunk's bytes) is not quoted
            # the commit of a round whose layers are there is refused whole: no manifest, no latest
            small = _model()
            save_stage(store, "j", 1, small, None, 0)
            _fill(store)
            with pytest.raises(redis.ResponseError):
                commit_checkpoint(store, "j", 1, len(small))
            assert latest_round(store, "j") is None
            assert committed_rounds(store, "j") == []
        finally:
            store.close()
