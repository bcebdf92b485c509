"""A worker mid-request of an old epoch abandons it as soon as a newer shard is announced.

After a device loss the coordinator re-plans and sends the survivors a
LoadShard of a new epoch. A survivor whose ring waits on the lost device's
tile must not sit out its `timeout_s` before taking that load: the control
thread announces the LoadShard, and the request's ring wait ends at once.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from common.errors import RoundAbortedError
from common.ids import DeviceId
from common.messages import Shutdown
from common.serving_messages import (
    LoadShard,
    ProfileBlocks,
    RunInference,
    ServeSpec,
    TransformerShape,
)
from services.coordinator.galaxy.planner import plan_megatron
from services.lib.galaxy import sources
from services.worker.serving import Served, Serving
from services.worker.tiles import Expecting

SHAPE = TransformerShape(
    kind="decoder", layers=2, hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=32
)
A, B = DeviceId("a"), DeviceId("b")


@pytest.fixture
def serving() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    # a ring wait far longer than the test may take: only the announcement can end it
    worker = Serving(ctx, A, None, 1 << 20, 120.0, lambda: None, store=None)  # type: ignore[arg-type]
    config = SHAPE.config()
    plan = plan_megatron(config, [A, B], 8)
    weights = sources.init_shard(config, 1, plan.head_range(0), plan.col_range(0))
    worker.served = Served("gpt", 3, plan, config, weights, [A, B])
    worker.inbox.expect(Expecting("gpt", 3, B))
    worker.dispatcher.set_peers({A: "tcp://127.0.0.1:1", B: "tcp://127.0.0.1:1"})
    worker.dispatcher.start()
    yield worker
    worker.close()
    ctx.term()


def load_of(epoch: int, worker: Serving) -> LoadShard:
    served = worker.served
    assert served is not None
    spec = ServeSpec(serve_id="gpt", model=SHAPE, seq_len=8)
    return LoadShard(
        serve_id="gpt", epoch=epoch, spec=spec, model=SHAPE, plan=served.plan, peers={}
    )


def test_a_request_waiting_on_a_lost_peer_ends_when_a_new_epoch_is_announced(serving):
    worker = serving
    worker.announce(load_of(3, worker))  # the load of the request's own epoch: no effect
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            worker.run(RunInference(serve_id="gpt", epoch=3, round=1, ids=[1, 2, 3], new_tokens=2))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "the request should wait for its peer's tile"
    worker.announce(load_of(4, worker))
    thread.join(30)
    assert not thread.is_alive(), "the stale request kept waiting"
    assert isinstance(outcome[0], RoundAbortedError)
    assert "gpt/4 comes" in str(outcome[0])


def test_a_request_of_the_announced_epoch_is_not_stale(serving):
    worker = serving
    worker.announce(load_of(3, worker))
    msg = RunInference(serve_id="gpt", epoch=3, round=1, ids=[1], new_tokens=0)
    assert worker._stale(msg)() is None
    worker.announce(load_of(5, worker))
    assert worker._stale(msg)() == "request 1 of gpt/3 is stale: gpt/5 comes"
    worker.announce(load_of(3, worker))
    config = SHAPE.model_copy()
    profile = ProfileBlocks(
        serve_id="next", epoch=1, model=config, seq_len=8, heads=[4], cols=[64], rows=[8]
    )
    worker.announce(profile)  # the next job profiles: this one's request is over
    assert worker._stale(msg)() == "request 1 of gpt/3 is stale: next/1 comes"
    shutdown = Shutdown(reason="test over")
    worker.announce(load_of(3, worker))
    worker.announce(shutdown)
    assert worker._stale(msg)() == "shutdown requested: test over"
