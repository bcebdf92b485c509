"""Malformed messages sent mid-round to a worker and to the coordinator.

Each is logged with the sender's identity, the services keep running, and
the job still ends with exactly the single-process result.
"""

from __future__ import annotations

import secrets
import time

import msgpack
import pytest
import torch
import zmq

from common.checkpoint import load_full_state
from common.codec import encode
from common.messages import PROTOCOL_VERSION, Activation
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import PLANS, SGD
from tests.reference import assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

ROUNDS = 15
# A gentle learning rate: over many rounds a chaotic loss curve would amplify
# float round-off past the exactness bound.
OPT = {**SGD, "lr": 0.01}


def _header(**over):
    h = {
        "v": PROTOCOL_VERSION,
        "sender": "intruder",
        "id": 1,
        "t": 0.0,
        "msg": {"type": "run_round", "epoch": 1, "round": 0},
        "tensors": [],
    }
    h.update(over)
    return msgpack.packb(h, use_bin_type=True)


FUTURE = PROTOCOL_VERSION + 1
"""A protocol version no peer speaks yet."""

BAD = {
    "garbage": [b"\x00\xff garbage \xc1"],
    "truncated msgpack": [_header()[:-7]],
    "100 GB tensor": [_header(tensors=[["float32", [25_000_000_000], 100_000_000_000]]), b"tiny"],
    "unknown type": [_header(msg={"type": "format_disk", "epoch": 1})],
    "wrong version": [_header(v=FUTURE)],
    # well-formed but from a plan epoch that does not exist: dropped by the pool
    "stale epoch": encode(
        Activation(epoch=999, round=3, mb=0, stage=1, lo=0, hi=8),
        "intruder",
        [torch.zeros(8, 4), torch.zeros(8, dtype=torch.int64)],
    ),
}


def _wait_running(store: Store, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.get_fields("job", job).get("round", 0) >= 2:
            return
        time.sleep(0.05)
    raise AssertionError("job never reached round 2")


def _blast(ctx: zmq.Context, addr: str) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"intruder/{secrets.token_hex(8)}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    for frames in BAD.values():
        sock.send_multipart(frames)
    sock.close()


def test_bad_messages_mid_round_are_logged_and_survived(tmp_path, redis_url, cluster_name, budget):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    stages = PLANS["hybrid"]
    job = {
        "job_id": "bad",
        "model": {"name": "small_cnn"},
        "seed": 7,
        "rounds": ROUNDS,
        "optimizer": OPT,
    }
    plan = {"global_batch": 32, "microbatches": 4, "stages": stages}
    store = Store(redis_url, cluster_name)
    ctx = zmq.Context()
    try:
        cluster.start_workers(["a", "b", "c", "d", "e"])
        cluster.start_coordinator(job, plan)
        _wait_running(store, "bad", budget.left(120))
        target = store.get_fields("device", "c")["data_addr"]
        _blast(ctx, target)
        _blast(ctx, cluster.addr)
        assert cluster.wait("coordinator", 240) == 0, cluster.log("coordinator")
        cluster.wait_workers_exit()
        rounds_done = store.get_fields("job", "bad")["round"]
        weights = load_full_state(store, "bad", ROUNDS)
    finally:
        cluster.close()
        ctx.destroy(0)
        store.close()
    assert rounds_done == ROUNDS
    ref, _ = reference_train(job["model"], 7, 32, ROUNDS, OPT)
    assert_matches_reference(weights, ref)

    def drops(name: str) -> list[dict]:
        return [
            e
            for e in cluster.log_events(name)
            if e.get("event", "").startswith("dropped") and e.get("peer") == "intruder"
        ]

    worker_drops = drops("c")
    assert len(worker_drops) == len(BAD), worker_drops
    assert any(f"version {FUTURE}" in e["reason"] for e in worker_drops)
    assert any("exceeds the limit" in e["reason"] for e in worker_drops)
    assert any("epoch 999" in e["reason"] for e in worker_drops)
    coord_drops = drops("coordinator")
    # each once: the control plane carries no tensors, so the two messages that announce
    # any (the 100 GB one and the stale Activation) are refused for their tensor list
    assert len(coord_drops) == len(BAD), coord_drops
    reasons = [e["reason"] for e in coord_drops]
    expected = {
        "undecodable header": 2,
        "bad tensor list": 2,
        "'format_disk'": 1,
        f"version {FUTURE}": 1,
    }
    for fragment, count in expected.items():
        assert sum(fragment in r for r in reasons) == count, (fragment, reasons)
