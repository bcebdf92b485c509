import hashlib

import pytest
import redis
import torch
from torch import nn

from common import store as store_mod
from common.checkpoint import (
    check_replicas,
    checkpoint_digests,
    checkpoint_hashes,
    commit_checkpoint,
    latest_round,
    load_full_state,
    load_stage,
    remove_orphans,
    restore_optimizer,
    save_stage,
    stage_blobs,
    stage_digest,
    stage_from_blobs,
)
from common.errors import CheckpointError, ConfigError, StoreError


def test_blob_roundtrip_in_chunks(store, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 1000)
    data = bytes(range(256)) * 40  # 10 chunks
    store.put_blob(data, "blob", "x")
    assert store.get_blob("blob", "x") == data
    assert store.get_blob("blob", "absent") is None
    store.r.delete(store.key("blob", "x", "chunk", 3))
    with pytest.raises(StoreError, match="missing chunks"):
        store.get_blob("blob", "x")


def test_streams_and_fields(store):
    store.append("metrics", "j", {"round": 0, "loss": 2.5})
    store.append("metrics", "j", {"round": 1, "loss": 2.0})
    assert [e["loss"] for e in store.read("metrics", "j")] == [2.5, 2.0]
    store.set_fields({"state": "running", "round": 3}, "job", "j")
    assert store.get_fields("job", "j") == {"state": "running", "round": 3}


def test_a_job_update_goes_to_redis_as_one_transaction(store):
    """The hash's round and the round's metrics land together or not at all."""
    with store.r.monitor() as monitor:
        store.update_job("j", {"round": 3}, {"metrics": ({"round": 2, "loss": 1.5}, 100)})
        seen = []
        while not seen or seen[-1] != "exec":
            seen.append(str(monitor.next_command()["command"]).split()[0].lower())
    assert seen[seen.index("multi") :] == ["multi", "hset", "xadd", "exec"], seen
    assert store.get_fields("job", "j") == {"round": 3}
    assert store.read("metrics", "j") == [{"round": 2, "loss": 1.5}]


def _model():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
    )


def _steps(model, opt, start, n):
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_resume_from_checkpoint_continues_exactly(store, kind):
    """Weights + optimizer state saved per layer, loaded into two stages, continue bit-exactly."""

    def make_opt(params):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    straight = _model()
    opt = make_opt(straight.parameters())
    _steps(straight, opt, 0, 6)

    model = _model()
    opt = make_opt(model.parameters())
    _steps(model, opt, 0, 3)
    save_stage(store, "j", 3, model, opt, 0)
    commit_checkpoint(store, "j", 3, len(model))
    assert latest_round(store, "j") == 3

    # resume as two stages [0, 3) and [3, 5), as a re-planned worker would
    stages = []
    for start, end in ((0, 3), (3, 5)):
        stage = nn.Sequential(*list(_model())[start:end])
        weights, optim = load_stage(store, "j", 3, start, end)
        stage.load_state_dict(weights)
        o = make_opt(stage.parameters())
        restore_optimizer(stage, o, optim)
        stages.append((stage, o))
    resumed = nn.Sequential(*stages[0][0], *stages[1][0])

    class Both:
        def zero_grad(self):
            for _, o in stages:
                o.zero_grad()

        def step(self):
            for _, o in stages:
                o.step()

    _steps(resumed, Both(), 3, 3)
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_incomplete_checkpoint_cannot_be_committed(store):
    model = _model()
    save_stage(store, "j", 1, model[:2], None, 0)
    with pytest.raises(CheckpointError, match=r"lacks layers \[2, 3, 4\]"):
        commit_checkpoint(store, "j", 1, 5)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        load_full_state(store, "j", 1)


def _trained(kind: str = "adam") -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model()
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.01)
        if kind == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    _steps(model, opt, 0, 2)
    return model, opt


@pytest.mark.parametrize(
    "where", ["weight", "buffer", "optimizer moment", "optimizer step", "nothing"]
)
def test_digest_sees_one_ulp_anywhere_in_the_saved_state(where):
    """Replicas are compared by digest, so a one-ulp difference in any saved tensor must show."""
    model, opt = _trained()
    before = stage_digest(model, opt)
    assert before == stage_digest(*_trained())  # same steps from the same seed: same bits
    with torch.no_grad():
        if where == "weight":
            w = model[2].weight
            w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
        elif where == "buffer":
            model[3].running_var[1] = torch.nextafter(model[3].running_var[1], torch.tensor(9.0))
        elif where == "optimizer moment":
            m = opt.state[model[4].bias]["exp_avg"]
            m[0] = torch.nextafter(m[0], torch.tensor(1.0))
        elif where == "optimizer step":
            opt.state[model[0].weight]["step"] += 1
    assert (stage_digest(model, opt) == before) == (where == "nothing")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_digest_covers_what_the_checkpoint_holds(store, kind):
    """A stage loaded from a checkpoint digests like the replica that wrote it."""
    model, opt = _trained(kind)
    save_stage(store, "j", 2, model, opt, 0)
    stage = nn.Sequential(*list(_model())[2:5])
    weights, optim = load_stage(store, "j", 2, 2, 5)
    stage.load_state_dict(weights)
    o: torch.optim.Optimizer = (
        torch.optim.Adam(stage.parameters(), lr=0.01)
        if kind == "adam"
        else torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    )
    restore_optimizer(stage, o, optim)
    alone = nn.Sequential(*list(model)[2:5])  # the writer's layers 2-4 and their state
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    alone_opt.state.update({p: opt.state[p] for p in alone.parameters()})
    assert stage_digest(stage, o) == stage_digest(alone, alone_opt)
    assert stage_digest(stage, o) != stage_digest(stage, None)


def test_diverged_replicas_are_named_and_agreeing_ones_recorded(store):
    same, other = "a" * 64, "b" * 64
    digests = [{"a": same, "b": same}, {"c": other}, {"d": same, "e": other, "f": same}]
    with pytest.raises(
        CheckpointError,
        match=r"round 4: the replicas of stage 2 diverged, expected one state, got 2 "
        r"\(d, f hold aaaaaaaaaaaa; e hold bbbbbbbbbbbb\)",
    ):
        check_replicas(4, digests)
    digests[2]["e"] = same
    check_replicas(4, digests)
    model = _model()
    save_stage(store, "j", 4, model, None, 0)
    commit_checkpoint(store, "j", 4, len(model), digests)
    assert checkpoint_digests(store, "j", 4) == digests


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_stage_moved_as_blobs_continues_exactly_like_the_original(kind):
    # a stage of layers 3..7 travels as per-layer blobs (a replica, a migration)
    model, opt = _trained(kind)
    blobs = stage_blobs(model, opt, 3)
    assert sorted(blobs) == [3, 4, 5, 6, 7]
    weights, optim = stage_from_blobs(blobs, 3, 8)
    moved = _model()
    moved.load_state_dict(weights)
    moved_opt = type(opt)(moved.parameters(), **opt.defaults)
    restore_optimizer(moved, moved_opt, optim)
    assert stage_digest(moved, moved_opt) == stage_digest(model, opt)
    _steps(model, opt, 2, 1)
    _steps(moved, moved_opt, 2, 1)
    for a, b in zip(model.state_dict().values(), moved.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_missing_or_corrupt_layer_blob_is_named():
    model, opt = _trained()
    blobs = stage_blobs(model, opt, 0)
    del blobs[3]
    with pytest.raises(CheckpointError, match="the state received has no layer 3"):
        stage_from_blobs(blobs, 0, 5)
    blobs[3] = b"not safetensors at all"
    with pytest.raises(CheckpointError, match="layer 3 is not valid safetensors"):
        stage_from_blobs(blobs, 0, 5, "the state received")


def test_a_blob_manifest_records_the_sha256_and_a_changed_chunk_is_refused(store, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 100)
    data = bytes(range(250))  # 3 chunks
    store.put_blob(data, "blob", "h")
    assert store.blob_manifest("blob", "h") == {
        "chunks": 3,
        "bytes": 250,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    store.r.set(store.key("blob", "h", "chunk", 1), bytes(100))  # same length, other bytes
    with pytest.raises(StoreError, match="manifest says " + hashlib.sha256(data).hexdigest()):
        store.get_blob("blob", "h")


def test_a_layer_rewritten_after_the_commit_is_named_by_the_checkpoint_hash(store):
    model, opt = _trained()
    save_stage(store, "j", 3, model, opt, 0)
    commit_checkpoint(store, "j", 3, 5)
    other = stage_blobs(_model(), None, 0)[2]  # a self-consistent blob, but not the committed one
    store.put_blob(other, "ckpt", "j", 3, "layer", 2)
    with pytest.raises(CheckpointError, match=r"layer 2 hashes to sha256 .* recorded"):
        load_full_state(store, "j", 3)
    assert (
        checkpoint_hashes(store, "j", 3)[4]
        == hashlib.sha256(stage_blobs(model, opt, 0)[4]).hexdigest()
    )


def test_a_commit_removes_abandoned_uploads_and_keeps_older_checkpoints(store, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 64)
    model, opt = _trained()
    blobs = stage_blobs(model, opt, 0)
    save_stage(store, "j", 1, model, opt, 0)
    commit_checkpoint(store, "j", 1, 5)
    store.put_blob(blobs[0], "ckpt", "j", 2, "layer", 0)  # round 2's upload was abandoned
    store.put_blob(b"x" * 200, "ckpt", "j", 1, "layer", 9)  # then rewritten smaller:
    store.put_blob(b"y", "ckpt", "j", 1, "layer", 9)  # chunks 1..3 of layer 9 are stale
    store.r.set(store.key("ckpt", "j", 1, "layer", 7, "chunk", 0), b"no manifest")
    save_stage(store, "j", 3, model, opt, 0)
    commit_checkpoint(store, "j", 3, 5)
    left = {k.decode().removeprefix(store.key("ckpt", "j", "")) for k in store.keys("ckpt", "j")}
    chunks = sum(-(-len(b) // 64) for b in blobs.values())
    assert not any(k.startswith("2:") for k in left)
    assert {k for k in left if k.startswith("1:layer:9:") or k.startswith("1:layer:7:")} == {
        "1:layer:9:chunk:0",
        "1:layer:9:manifest",
    }
    assert len([k for k in left if k.startswith("1:")]) == 1 + 5 + chunks + 2
    assert store.get_blob("ckpt", "j", 1, "layer", 9) == b"y"
    assert latest_round(store, "j") == 3
    load_full_state(store, "j", 1)


def test_orphan_removal_refuses_a_job_id_that_is_not_one(store):
    with pytest.raises(ConfigError, match="job_id from the checkpoint's job"):
        remove_orphans(store, "j*")


class _FakeRedis:
    """Answers WAITAOF as a Redis 7.2 would, or refuses it as an older one does."""

    def __init__(self, *replies: object) -> None:
        self.replies = list(replies)
        self.calls: list[tuple[object, ...]] = []

    def execute_command(self, *args: object) -> object:
        self.calls.append(args)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_wait_durable_reads_the_local_fsync_count_of_waitaof(store, monkeypatch):
    fake = _FakeRedis([1, 0], [0, 0])
    monkeypatch.setattr(store, "r", fake)
    assert store.wait_durable(0.25) is True
    assert store.wait_durable(0) is False  # timed out before the fsync
    assert fake.calls == [("WAITAOF", 1, 0, 250), ("WAITAOF", 1, 0, 1)]


def test_wait_durable_asks_an_old_server_only_once(store, monkeypatch):
    fake = _FakeRedis(redis.ResponseError("unknown command 'WAITAOF'"))
    monkeypatch.setattr(store, "r", fake)
    assert store.wait_durable() is False
    assert store.wait_durable() is False
    assert len(fake.calls) == 1
