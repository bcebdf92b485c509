"""A worker SIGKILLed mid-generation does not end the serving job, and a new one is taken in.

Three real worker processes serve a decoder in galaxy mode with a real
coordinator and Redis. One is killed while a long greedy generation runs: the
coordinator declares it lost, re-plans on the two survivors under a new epoch,
they load their new shards, and the request runs again as its prompt plus the
tokens generated so far. The client's answer equals the single-process
reference (`services.lib.galaxy.model.generate`), the recovery time is in the
job's metrics, and a worker started afterwards is in the next plan. A model
the survivors cannot hold ends the job naming the shortfall.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from common.serving_messages import InferReply, InferRequest, ServeSpec, TransformerShape
from common.settings import CoordinatorSettings
from services.coordinator.galaxy.cost import device_memory_bytes
from services.coordinator.serve_state import Serve
from services.coordinator.service import Coordinator
from services.coordinator.serving import ServeRun
from services.lib.galaxy import model
from tests.cluster import LocalCluster
from tests.integration.test_serving import Serving, _send_requests

pytestmark = pytest.mark.integration

LONG = TransformerShape(
    kind="decoder",
    layers=4,
    hidden=64,
    heads=8,
    ffn=128,
    vocab_size=300,
    max_positions=128,
    ln_eps=1e-5,
)
"""Deep and long enough that a generation is still running when its worker is killed."""
PROMPT = [5, 17, 3, 250, 9, 9, 1, 42, 7, 7, 100, 2]
NEW = 96
SEQ = 12
WORKERS = ["a", "b", "c"]


def budget_for(shape: TransformerShape, share: float) -> int:
    """A device budget that holds `share` of the model's split part beyond what it holds whole."""
    config = shape.config()
    fixed = device_memory_bytes(config, SEQ, 0, 0, 0)
    whole = device_memory_bytes(config, SEQ, config.heads, config.ffn, SEQ)
    return fixed + int((whole - fixed) * share)


@pytest.fixture
def start(tmp_path, redis_url, cluster_name) -> Iterator[Callable[[int], Serving]]:
    """Start the workers with a memory budget each, and a coordinator; stop them after."""
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    coord = Coordinator(
        CoordinatorSettings(
            bind=cluster.addr,
            redis_url=redis_url,
            cluster=cluster_name,
            heartbeat_s=0.3,
            heartbeat_misses=3,
            probe_timeout_s=1.0,
        )
    )
    made: list[Serving] = []

    def begin(budget: int) -> Serving:
        cluster.env["ASTEROID_MEMORY_BUDGET"] = str(budget)
        cluster.start_workers(WORKERS)
        coord.wait_for_devices([*WORKERS], 60)  # type: ignore[list-item]
        made.append(Serving(cluster, coord))
        return made[0]

    try:
        yield begin
        for serving in made:
            if serving.thread is not None and serving.thread.is_alive():
                coord.stop("test over")
                serving.thread.join(30)
        coord.shutdown_workers("test over")
        cluster.wait_workers_exit(
            30, names=[n for n, p in cluster.procs.items() if p.poll() is None]
        )
    finally:
        coord.close()
        cluster.close()


def core_of(serving: Serving) -> Serve | None:
    """The serving job's core state, as the coordinator's thread last left it (immutable)."""
    active = serving.coord.active
    return active.core if isinstance(active, ServeRun) else None


def serving_now(serving: Serving) -> bool:
    core = core_of(serving)
    return core is not None and core.phase == "serving"


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metrics(serving: Serving, jid: str) -> list[dict[str, Any]]:
    store = serving.coord.store
    out = []
    for _, entry in store.r.xrange(store.key("metrics", jid)):
        out.append({k.decode(): v.decode() for k, v in entry.items()})
    return out


def test_a_worker_killed_mid_generation_is_recovered_from_and_a_new_one_joins(start):
    serving = start(256 << 20)
    spec = ServeSpec(serve_id="gpt-rec", model=LONG, seed=3, mode="galaxy", seq_len=SEQ)
    serving.start(spec)
    # a worker the job never had starts now (it boots meanwhile): the job, started on the
    # three, takes it in place of the one it loses, once the request is answered
    serving.cluster.start_workers(["d"])
    wait_for("the shards to be loaded", lambda: serving_now(serving))
    core = core_of(serving)
    assert core is not None and core.plan is not None
    assert sorted(core.plan.devices) == WORKERS
    first_epoch = core.epoch

    ask = InferRequest(serve_id="gpt-rec", ids=PROMPT, new_tokens=NEW, logits=False)
    replies: list[InferReply] = []
    asking = threading.Thread(
        target=lambda: replies.extend(_send_requests(serving.cluster.addr, "alice", [ask])),
        daemon=True,
    )
    asking.start()

    def generating() -> bool:
        core = core_of(serving)
        return core is not None and core.running is not None and len(core.running.generated) >= 8

    wait_for("the generation to be under way", generating)
    victim = core.plan.devices[0]  # the ring's first device: the one that answers
    serving.cluster.procs[victim].send_signal(signal.SIGKILL)
    killed_at = len(core_of(serving).running.generated)  # type: ignore[union-attr]
    assert killed_at < NEW, "the generation ended before the worker was killed"
    config = LONG.config()
    w = model.init_weights(config, 3)
    with torch.no_grad():
        want = model.generate(torch.tensor(PROMPT), w, config, NEW)
    asking.join(150)
    assert not asking.is_alive() and len(replies) == 1
    reply = replies[0]
    assert reply.ok, reply.error
    assert reply.tokens == want  # as an undisturbed greedy run answers

    core = core_of(serving)
    assert core is not None and core.plan is not None
    assert core.epoch > first_epoch and victim not in core.plan.devices
    entries = metrics(serving, "gpt-rec")
    recovered = [e for e in entries if e.get("recovery_s")]
    assert len(recovered) == 1, entries
    assert float(recovered[0]["recovery_s"]) > 0
    assert victim in json.loads(recovered[0]["lost"])

    # the new worker is taken in at the next idle moment: the next plan includes it
    def joined() -> bool:
        core = core_of(serving)
        return (
            core is not None
            and core.phase == "serving"
            and core.plan is not None
            and "d" in core.plan.devices
        )

    wait_for("the new worker to be in the plan", joined, 90)
    again = _send_requests(serving.cluster.addr, "bob", [ask.model_copy(update={"new_tokens": 8})])
    assert again and again[0].ok, again
    assert again[0].tokens == want[:8]
    serving.stop("gpt-rec")


def test_a_loss_the_survivors_cannot_absorb_ends_the_job_naming_the_shortfall(start):
    shape = LONG.model_copy(update={"hidden": 256, "ffn": 1024})
    serving = start(budget_for(shape, 0.4))  # three devices hold it, two do not
    spec = ServeSpec(serve_id="tight", model=shape, seed=3, mode="galaxy", seq_len=SEQ)
    serving.start(spec)
    ask = InferRequest(serve_id="tight", ids=PROMPT, new_tokens=NEW, logits=False)
    replies: list[InferReply] = []
    asking = threading.Thread(
        target=lambda: replies.extend(_send_requests(serving.cluster.addr, "alice", [ask])),
        daemon=True,
    )
    asking.start()

    def running() -> bool:
        core = core_of(serving)
        return core is not None and core.running is not None and len(core.running.generated) >= 1

    wait_for("the request to run", running)
    serving.cluster.procs["b"].send_signal(signal.SIGKILL)
    asking.join(60)
    assert serving.thread is not None
    serving.thread.join(60)
    assert len(replies) == 1 and not replies[0].ok
    error = replies[0].error
    assert "cannot hold the model: no split fits" in error, error
    fields = serving.coord.store.get_fields("job", "tight")
    assert fields["state"] == "failed"
    assert "cannot hold the model" in fields["error"]
