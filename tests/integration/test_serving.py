"""A model served across real worker processes answers as single-device inference does.

Three workers over ZeroMQ with a real Redis; the coordinator runs the serving
job (profile, plan, load, requests) on its own thread, and requests arrive the
way programs and `asteroid infer` send them (`services.cli.serve.infer_request`).
Every answer is checked against the single-process reference of the same
seeded weights: encoder logits, decoder next-token logits and generated tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from common.checkpoint import commit_checkpoint, save_stage
from common.codec import Limits, recv_message, send_message
from common.job import JobSpec
from common.messages import CancelJob
from common.serving_messages import (
    InferReply,
    InferRequest,
    ServeModel,
    ServeSpec,
    TransformerShape,
)
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from common.zoo import build_model
from services.cli.client import ask_coordinator
from services.cli.serve import infer_request
from services.coordinator.service import Coordinator
from services.lib.galaxy import model
from tests.cluster import LocalCluster

pytestmark = pytest.mark.integration

DECODER = TransformerShape(
    kind="decoder",
    layers=2,
    hidden=48,
    heads=6,
    ffn=96,
    vocab_size=300,
    max_positions=64,
    ln_eps=1e-5,
)
ENCODER = TransformerShape(
    kind="encoder",
    layers=2,
    hidden=48,
    heads=6,
    ffn=96,
    vocab_size=300,
    max_positions=64,
    num_classes=5,
)
WORKERS = ["a", "b", "c"]
BUDGET = 256 << 20
"""Each worker's memory budget: the models here need a few MiB."""


class Serving:
    """A coordinator serving on a thread of this test, with workers as processes."""

    def __init__(self, cluster: LocalCluster, coord: Coordinator) -> None:
        self.cluster, self.coord = cluster, coord
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.serve_id: str | None = None

    def start(self, spec: ServeSpec) -> None:
        def serve() -> None:
            try:
                self.coord.serve(stop_after=spec.serve_id)
            except BaseException as exc:  # reported by `stop`, never lost
                self.error = exc

        self.thread = threading.Thread(target=serve, name="coordinator", daemon=True)
        self.thread.start()
        self.serve_id = spec.serve_id
        reply = ask_coordinator(self.cluster.addr, ServeModel(spec=spec), 30)
        assert reply.ok, reply.error

    def stop(self, serve_id: str) -> None:
        reply = ask_coordinator(self.cluster.addr, CancelJob(job_id=serve_id), 30)
        assert reply.ok, reply.error
        assert self.thread is not None
        self.thread.join(60)
        assert not self.thread.is_alive(), "the serving job did not end after its cancel"
        assert self.error is None, self.error

    def settle(self, serve_id: str | None) -> None:
        """After a failed test: cancel its job so that the next test finds the cluster idle."""
        if self.thread is not None and self.thread.is_alive() and serve_id is not None:
            ask_coordinator(self.cluster.addr, CancelJob(job_id=serve_id), 30)
            self.thread.join(60)
        if self.thread is not None and self.thread.is_alive():
            # the loop stops at its next turn, before this thread uses its socket
            self.coord.stop("test failed mid-serve")
            self.thread.join(30)
        self.thread, self.error, self.serve_id = None, None, None


@pytest.fixture
def serving(tmp_path, redis_url, cluster_name) -> Iterator[Serving]:
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    coord = Coordinator(
        CoordinatorSettings(
            bind=cluster.addr, redis_url=redis_url, cluster=cluster_name, heartbeat_s=0.3
        )
    )
    # budgets as small as an edge device's, so a model beyond them is refused, not tried
    cluster.env["ASTEROID_MEMORY_BUDGET"] = str(BUDGET)
    try:
        cluster.start_workers(WORKERS)
        coord.wait_for_devices([*WORKERS], 60)  # type: ignore[list-item]
        serving = Serving(cluster, coord)
        yield serving
        if serving.thread is not None and serving.thread.is_alive():
            # a test failed mid-serve: the loop stops at its next turn, before the socket
            # is used from this thread (two threads on one ZeroMQ socket crash)
            coord.stop("test over")
            serving.thread.join(30)
        coord.shutdown_workers("test over")
        cluster.wait_workers_exit(30)
    finally:
        coord.close()
        cluster.close()


def _state(coord: Coordinator, jid: str) -> str:
    return str(coord.store.get_fields("job", jid).get("state"))


@pytest.mark.parametrize("mode", ["galaxy", "megatron", "sp", "local"])
def test_a_served_decoder_answers_like_single_device_inference(serving, mode):
    spec = ServeSpec(serve_id=f"gpt-{mode}", model=DECODER, seed=3, mode=mode, seq_len=12)
    serving.start(spec)
    config = DECODER.config()
    w = model.init_weights(config, 3)
    prompts = [[5, 17, 3, 250, 9, 9, 1, 42, 7, 7, 100, 2], [11, 4]]
    for n, ids in enumerate(prompts, start=1):
        reply = infer_request(serving.cluster.addr, spec.serve_id, ids, new_tokens=4)
        assert reply.ok, reply.error
        assert reply.request == n
        with torch.no_grad():
            want = model.forward(torch.tensor(ids), w, config)[-1]
        got = torch.tensor(reply.logits)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
        assert reply.tokens == model.generate(torch.tensor(ids), w, config, 4)
        assert reply.latency_s > 0
    assert _state(serving.coord, spec.serve_id) == "running"
    metrics = serving.coord.store.r.xlen(serving.coord.store.key("metrics", spec.serve_id))
    serving.stop(spec.serve_id)
    assert metrics == len(prompts)
    assert _state(serving.coord, spec.serve_id) == "cancelled"


def test_a_served_encoder_classifies_like_single_device_inference(serving):
    spec = ServeSpec(serve_id="bert", model=ENCODER, seed=4, seq_len=16, overlap=True)
    serving.start(spec)
    config = ENCODER.config()
    w = model.init_weights(config, 4)
    ids = list(range(3, 19))
    reply = infer_request(serving.cluster.addr, "bert", ids)
    assert reply.ok, reply.error
    with torch.no_grad():
        want = model.forward(torch.tensor(ids), w, config)
    assert torch.allclose(torch.tensor(reply.logits), want, atol=1e-5, rtol=0)
    refused = infer_request(serving.cluster.addr, "bert", ids, new_tokens=2)
    assert not refused.ok and "only a decoder generates" in refused.error
    refused = infer_request(serving.cluster.addr, "bert", [1, 300])
    assert not refused.ok and "token ids must be in [0, 300)" in refused.error
    again = infer_request(serving.cluster.addr, "bert", ids)  # a refusal ends nothing
    assert again.ok and again.logits == reply.logits
    serving.stop("bert")
    assert _state(serving.coord, "bert") == "cancelled"


def test_a_request_for_a_job_that_is_not_serving_is_refused_at_once(serving):
    replies: list[InferReply] = []
    asking = threading.Thread(
        target=lambda: replies.append(
            infer_request(serving.cluster.addr, "nothing-here", [1, 2, 3], timeout_s=10)
        ),
        daemon=True,
    )
    asking.start()
    while asking.is_alive():  # the coordinator answers from its own loop
        serving.coord.pump(0.1)
    assert len(replies) == 1 and not replies[0].ok
    assert "no serving job nothing-here is running" in replies[0].error


def test_a_trained_bert_small_checkpoint_is_served_with_its_trained_weights(serving):
    """The checkpoint a training job commits is what the devices serve (split by heads)."""
    store = serving.coord.store
    job = JobSpec.model_validate(
        {
            "job_id": "trained",
            "model": {
                "name": "bert_small",
                "num_classes": 3,
                "options": {"vocab_size": 50, "seq_len": 16, "hidden": 48, "heads": 6, "layers": 2},
            },
            "seed": 5,
            "rounds": 1,
        }
    )
    store.put_json(job.model_dump(mode="json"), "jobspec", job.job_id)
    zoo = build_model(job.model, job.seed)
    with torch.no_grad():  # what training did to it: weights unlike any seeded initialisation
        for p in zoo.full().parameters():
            p.add_(0.05 * torch.randn_like(p))
    full = zoo.full()
    save_stage(store, job.job_id, 2, full, None, 0)
    commit_checkpoint(store, job.job_id, 2, len(zoo.layers))
    spec = ServeSpec(serve_id="served", source="checkpoint", job="trained", seq_len=16)
    serving.start(spec)
    ids = [(7 * i) % 50 for i in range(16)]
    reply = infer_request(serving.cluster.addr, "served", ids)
    assert reply.ok, reply.error
    with torch.no_grad():
        want = full.eval()(torch.tensor([ids]))[0]
    assert torch.allclose(torch.tensor(reply.logits), want, atol=1e-5, rtol=0)
    serving.stop("served")


def test_a_model_the_devices_cannot_hold_fails_naming_what_it_needs(serving):
    huge = TransformerShape(
        kind="decoder",
        layers=64,
        hidden=2048,
        heads=16,
        ffn=8192,
        vocab_size=1000,
        max_positions=512,
        ln_eps=1e-5,
    )
    spec = ServeSpec(serve_id="huge", model=huge, seq_len=64)
    serving.start(spec)
    serving.thread.join(60)  # it fails at planning, before any device allocates a layer
    assert not serving.thread.is_alive()
    fields = serving.coord.store.get_fields("job", "huge")
    assert fields["state"] == "failed"
    assert "no split fits: the model's layers need" in fields["error"]
    events = serving.coord.store.r.xrange(serving.coord.store.key("events", "huge"))
    assert b"profiling" not in b" ".join(v for _, e in events for v in e.values())


def _send_requests(addr: str, name: str, msgs: list[InferRequest]) -> list[InferReply]:
    """Send `msgs` at once from one connection, as one greedy program would; their replies."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = connect_dealer(ctx, addr, name)
    try:
        for msg in msgs:
            send_message(sock, msg, name)
        replies: list[InferReply] = []
        deadline = time.monotonic() + 120
        while len(replies) < len(msgs) and time.monotonic() < deadline:
            if sock.poll(100, zmq.POLLIN):
                got = recv_message(sock, Limits())[1].msg
                if isinstance(got, InferReply):
                    replies.append(got)
        return replies
    finally:
        sock.close(0)
        ctx.term()


def test_a_greedy_requester_neither_starves_another_nor_waits_past_its_wait(serving):
    """30 requests from one peer: 16 wait, the rest are refused; another peer is served next.

    Requests that waited past their `wait_s` are answered saying so, not run.
    """
    spec = ServeSpec(serve_id="fair", model=DECODER, seed=3, mode="local", seq_len=12)
    serving.start(spec)
    ids = [5, 17, 3, 250, 9, 9, 1, 42, 7, 7, 100, 2]
    slow = InferRequest(serve_id="fair", ids=ids, new_tokens=40)
    greedy: list[InferReply] = []
    sender = threading.Thread(
        target=lambda: greedy.extend(_send_requests(serving.cluster.addr, "greedy", [slow] * 30))
    )
    sender.start()
    deadline = time.monotonic() + 30
    while len(serving.coord.infer_queue) < 12:  # greedy's requests wait; one runs
        assert time.monotonic() < deadline, "greedy's requests never queued"
        time.sleep(0.01)
    polite = infer_request(serving.cluster.addr, "fair", ids, new_tokens=1)
    sender.join(150)
    assert polite.ok, polite.error
    refused = [r for r in greedy if not r.ok]
    # 16 wait and the others are refused; how many ran before the last arrived depends on
    # the machine's load, so each of those freed a place: at least 16 are answered
    assert len(greedy) == 30 and 1 <= len(refused) <= 14, [r.error for r in refused]
    assert all("16 requests of greedy already wait" in r.error for r in refused)
    overtaken = [r.request for r in greedy if r.ok and r.request > polite.request]
    assert len(overtaken) >= 8, (polite.request, overtaken)  # not behind all that waited

    # requests run back to back, each a round trip and 40 decoding steps (well over 1 ms):
    # of 8 sent at once, those behind the first wait longer than 1 ms for their turn
    impatient = InferRequest(serve_id="fair", ids=ids, new_tokens=40, wait_s=0.001)
    late = [r for r in _send_requests(serving.cluster.addr, "impatient", [impatient] * 8)]
    waited = [r for r in late if not r.ok and "for its turn" in r.error]
    assert len(late) == 8 and waited, [r.error for r in late]
    assert all(r.ok for r in late if r not in waited)
    serving.stop("fair")
