"""Link measurement under attack: forged answers and stray probe data are refused.

The coordinator takes a LinksMeasured only from the worker it asked, with the
nonce it asked under, once; a bandwidth sink takes probe data only after its
prober's hello, only from worker keys under CURVE; and both keep serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from common.codec import encode
from common.curve import CurveKeys, create_key_set
from common.ids import DeviceId
from common.job import JobSpec, ModelSpec
from common.messages import Heartbeat, LinkData, LinkHello, LinksMeasured
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from services.coordinator import prepare, prepare_steps
from services.coordinator.core import Beats, ProbeAnswer, Reply, Tick
from services.coordinator.job_effects import Effects, prep_limits
from services.coordinator.membership import Members
from services.coordinator.prepare_state import Prep
from services.coordinator.service import Coordinator
from services.worker.bandwidth import BandwidthSink, probe_link
from tests.cluster import LocalCluster

A, B = DeviceId("a"), DeviceId("b")
ABSENT = "tcp://127.0.0.1:1"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _coordinator(redis_url: str, cluster_name: str, bind: str) -> Coordinator:
    settings = CoordinatorSettings(
        bind=bind, redis_url=redis_url, cluster=cluster_name, link_probe_timeout_s=2.0
    )
    return Coordinator(settings)


def _pump_until(coord: Coordinator, done: Callable[[], bool], what: str, limit: float = 20) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        coord.pump(0.05)


def measure_links(coord: Coordinator, members: Members) -> dict[str, float]:
    """Measure the links among `members` as a job's preparation does; bytes/s by pair.

    The preparation core's link step, fed the coordinator's events, its commands
    carried out by a job's effects (the matrix stored in Redis) until it moves on.
    """
    job = JobSpec(job_id="links", model=ModelSpec(name="mlp"), global_batch=2)
    effects = Effects(coord, job, lambda *_, **__: None, None)
    prep = Prep(
        job=job,
        layers=1,
        limits=prep_limits(coord),
        replan=True,
        chosen=dict(members),
        keys={d: "profile" for d in members},  # profiled, as a preparation has them by now
        budgets={"profile": 1 << 30},
    )
    prep = effects.prepared(*prepare_steps.measure_from(prep, time.monotonic()))
    deadline = time.monotonic() + 60
    coord.collecting = True
    try:
        while prep.phase == "links":
            assert time.monotonic() < deadline, "the links were not measured in time"
            for event in coord.events():
                if isinstance(event, Beats | Reply | ProbeAnswer | Tick):
                    prep = effects.prepared(*prepare.apply(prep, event, time.monotonic()))
    finally:
        coord.collecting = False
    return dict(prep.rates)


def test_the_coordinator_takes_only_the_answer_it_asked_for(ctx, redis_url, cluster_name):
    coord = _coordinator(redis_url, cluster_name, f"tcp://127.0.0.1:{free_port()}")
    a = connect_dealer(ctx, coord.endpoint, "a")
    b = connect_dealer(ctx, coord.endpoint, "b")
    mallory = connect_dealer(ctx, coord.endpoint, "mallory")
    try:
        a.send_multipart(encode(LinksMeasured(device=A, nonce=5, rates={B: 1e9}), "a"))
        _pump_until(coord, lambda: coord.bad_messages == 1, "the unsolicited answer")
        mallory.send_multipart(encode(LinksMeasured(device=A, nonce=5, rates={B: 1e9}), "a"))
        _pump_until(coord, lambda: coord.bad_messages == 2, "the answer posing as a")
        huge = encode(LinksMeasured(device=A, nonce=5), "a")
        header = msgpack.unpackb(huge[0])
        header["msg"]["rates"] = {f"d{i}": 1.0 for i in range(65)}  # one past the bound
        a.send(msgpack.packb(header))
        _pump_until(coord, lambda: coord.bad_messages == 3, "the oversized answer")
        nonce = coord.link_nonce(A)
        b.send_multipart(encode(LinksMeasured(device=B, nonce=nonce, rates={A: 1e9}), "b"))
        _pump_until(coord, lambda: coord.bad_messages == 4, "an answer of the wrong worker")
        assert not coord.inbox
        honest = LinksMeasured(device=A, nonce=nonce, rates={B: 2e6})
        a.send_multipart(encode(honest, "a"))
        _pump_until(coord, lambda: bool(coord.inbox), "the answer asked for")
        assert list(coord.inbox) == [(A, honest)]
        a.send_multipart(encode(honest, "a"))  # a replay of it
        _pump_until(coord, lambda: coord.bad_messages == 5, "the replayed answer")
        assert len(coord.inbox) == 1 and not coord.links_pending
        a.send_multipart(encode(Heartbeat(device=A, data_addr="tcp://127.0.0.1:2"), "a"))
        _pump_until(coord, lambda: A in coord.members, "a's heartbeat")  # still serving
    finally:
        for sock in (a, b, mallory):
            sock.close(0)
        coord.close()


def test_a_sink_refuses_probe_data_from_a_non_worker_key(ctx, tmp_path: Path):
    create_key_set(tmp_path, workers=["w1", "w2"], services=["planner"], operators=["op"])
    w1 = CurveKeys.load(tmp_path, "worker", "w1")
    with BandwidthSink(ctx, keys=w1) as sink:
        for role, name in (("service", "planner"), ("operator", "op")):
            keys = CurveKeys.load(tmp_path, role, name)
            sock = connect_dealer(ctx, sink.endpoint, f"{name}/bw-x", 5, keys, w1.public)
            try:
                sock.send_multipart(encode(LinkHello(probe="x", count=1, nbytes=4), name))
                data = LinkData(probe="x", seq=0)
                sock.send_multipart(encode(data, name, [torch.zeros(4, dtype=torch.uint8)]))
                assert not sock.poll(500)  # no ready, no done
            finally:
                sock.close(0)
        assert sink.bad_messages == 0  # refused at the handshake: nothing reached it
        w2 = CurveKeys.load(tmp_path, "worker", "w2")
        assert probe_link(ctx, sink.endpoint, 1024, 2, 10, keys=w2, sink="w1").mb_per_s > 0


def _garbage(ctx: zmq.Context[Any], addr: str) -> None:
    """Probe data without a hello, undecodable bytes and a terabyte announced, at a sink."""
    sock = connect_dealer(ctx, addr, "stray", 5)
    try:
        data = LinkData(probe="nobody", seq=0)
        sock.send_multipart(encode(data, "stray", [torch.zeros(8, dtype=torch.uint8)]))
        sock.send(b"\xc1 not msgpack")
        header = msgpack.unpackb(encode(data, "stray")[0])
        header["tensors"] = [["uint8", [1 << 40], 1 << 40]]
        sock.send(msgpack.packb(header))
        assert not sock.poll(300)
    finally:
        sock.close(0)


def test_real_workers_measure_despite_garbage_and_unmeasurable_pairs_fall_back(
    ctx, tmp_path: Path, redis_url, cluster_name, budget, store
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    coord = _coordinator(redis_url, cluster_name, cluster.addr)
    ghost = connect_dealer(ctx, coord.endpoint, "ghost")
    try:
        cluster.start_workers(["a", "b"])
        _pump_until(coord, lambda: {A, B} <= set(coord.members), "the workers", 120)
        sink_b = coord.members[B].info.link_addr
        assert sink_b.startswith("tcp://127.0.0.1:")
        _garbage(ctx, sink_b)
        # a device whose sink is nowhere: its pairs cannot be measured
        beat = Heartbeat(device=DeviceId("ghost"), data_addr=ABSENT, link_addr=ABSENT)
        ghost.send_multipart(encode(beat, "ghost"))
        _pump_until(coord, lambda: "ghost" in coord.members, "the ghost")
        rates = measure_links(coord, dict(coord.members))
        matrix = store.get_json("links")
        assert set(rates) == {"a|b"} and rates["a|b"] > 0
        assert matrix["links"] == rates and set(matrix["errors"]) == {"a|ghost", "b|ghost"}
        assert "no 'link_ready' reply" in matrix["errors"]["a|ghost"]
        assert all(p.poll() is None for p in cluster.procs.values())  # the workers survived
        _pump_until(coord, lambda: coord.members[B].beats > 3, "b's heartbeats")
        assert not coord.links_pending
    finally:
        ghost.close(0)
        coord.close()
        cluster.close()
    stray = [e for e in cluster.log_events("b") if e.get("event", "").startswith("dropped bad")]
    assert len(stray) == 3 and {e["peer"] for e in stray} == {"stray"}, stray
