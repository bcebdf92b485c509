"""The federation service against a hostile or broken home, over real sockets.

One `asteroid-federation` process and this test as its only home: garbage frames,
a join for another model, updates with a non-finite weight, a wrong shape or no
model frame are each refused with a reason naming the home; none changes the
global model or stops the service, and a correct update afterwards is merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from common.codec import Envelope, Limits, recv_message, send_message
from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.fl.wire import state_frame, state_from_frame
from common.ports import free_port
from common.sockets import connect_dealer
from common.zoo import ModelSpec, build_model
from tests.cluster import LocalCluster

pytestmark = pytest.mark.integration

MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 4, "hidden": 8},
}
HISTOGRAM = [5, 5, 0, 0, 0, 0, 0, 0, 0, 10]


class Home:
    """A DEALER speaking as home 0."""

    def __init__(self, address: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = connect_dealer(self.ctx, address, "home-0")

    def ask(self, msg: Any, tensors: list[torch.Tensor] | None = None) -> Envelope:
        send_message(self.sock, msg, "home-0", tensors or [])
        assert self.sock.poll(30_000, zmq.POLLIN), "the federation did not answer"
        return recv_message(self.sock, Limits())[1]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def federation(tmp_path, redis_url, cluster_name) -> Iterator[tuple[LocalCluster, Home]]:
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = {"federation_id": "f", "model": MODEL, "homes": 1, "updates": 1, "strategy": "fedavg"}
    path = cluster.write("federation.yaml", spec)
    cluster.spawn(
        "federation",
        [
            "-m",
            "services.federation.main",
            "--bind",
            address,
            "--spec",
            str(path),
            "--exit-when-done",
        ],
    )
    home = Home(address)
    try:
        yield cluster, home
    finally:
        home.close()
        cluster.close()


def _refused(env: Envelope, *words: str) -> None:
    assert isinstance(env.msg, FederationReply) and not env.msg.ok, env.msg
    for word in words:
        assert word in env.msg.error, env.msg.error


def test_bad_homes_are_refused_and_change_nothing(federation):
    cluster, home = federation
    reference = build_model(ModelSpec.model_validate(MODEL), 0).full().state_dict()
    # frames that are no message at all, then a message of a kind nobody sends here
    home.sock.send_multipart([b"\xc1 not msgpack", b"x"])
    other = dict(MODEL, options={**MODEL["options"], "width": 8})
    wrong = JoinFederation(
        federation="f",
        home=0,
        model=ModelSpec.model_validate(other),
        num_samples=20,
        histogram=HISTOGRAM,
    )
    _refused(home.ask(wrong), "home 0", "trains fl_cnn")
    _refused(home.ask(FetchModel(federation="f", home=0)), "home 0 has not joined")
    _refused(home.ask(FetchModel(federation="g", home=0)), "this is federation f")
    join = wrong.model_copy(update={"model": ModelSpec.model_validate(MODEL)})
    assert home.ask(join).msg == FederationReply(federation="f", home=0, ok=True)
    task = home.ask(FetchModel(federation="f", home=0))
    assert isinstance(task.msg, FederatedModel) and task.msg.status == "train"
    start = state_from_frame(task.tensors, reference, "test")
    update = HomeUpdate(
        federation="f", home=0, round_id=task.msg.round_id, num_samples=20, latency_s=0.5
    )
    poisoned = {k: v.clone() for k, v in start.items()}
    first = next(iter(poisoned))
    poisoned[first].view(-1)[0] = float("nan")
    _refused(home.ask(update, [state_frame(poisoned)]), "home 0", "not finite")
    reshaped = dict(start, **{first: torch.zeros(3)})
    _refused(home.ask(update, [state_frame(reshaped)]), "home 0", first)
    _refused(home.ask(update), "home 0", "one uint8 frame")
    late = home.ask(update.model_copy(update={"round_id": 99}), [state_frame(start)])
    _refused(late, "home 0", "round 99")
    assert isinstance(late.msg, FederationReply) and late.msg.stale  # the home asks again
    # the round still waits for its update; the right one is merged and ends the run
    trained = {k: v + 1.0 if v.is_floating_point() else v for k, v in start.items()}
    taken = home.ask(update, [state_frame(trained)])
    assert isinstance(taken.msg, FederationReply) and taken.msg.ok and taken.msg.version == 1
    done = home.ask(FetchModel(federation="f", home=0))
    assert isinstance(done.msg, FederatedModel) and done.msg.status == "done"
    assert cluster.wait("federation", 30) == 0
    log = cluster.log("federation")
    assert "refused" in log and "Traceback" not in log
