"""A home with a valid key tries to poison the federation, over real sockets.

One `asteroid-federation` process over CURVE, three homes played by this test: homes
0 and 1 train their digits shares the plain way; home 2 holds a valid key and claims
2^40 samples, then sends weights of 3e38. The claim is refused at join, and its
update is rejected when the round is screened: the global model the federation
stores and scores is FedAvg of the honest homes alone (as `fedavg` computes it here,
to float round-off; so is its held-out accuracy), and the federation's
metrics and log name home 2 and the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from common.codec import Envelope, Limits, recv_message, send_message
from common.curve import COORDINATOR, CurveKeys, create_key_set
from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.fl.data import DIGIT_CLASSES, home_share, label_histogram, load_digits_split
from common.fl.wire import state_frame, state_from_frame
from common.ports import free_port
from common.sockets import connect_dealer
from common.store import Store
from common.zoo import ModelSpec, build_model
from services.federation.aggregate import fedavg
from services.federation.simulate import SimConfig, local_train
from tests.cluster import LocalCluster

pytestmark = pytest.mark.integration

MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 8, "hidden": 32},
}
ALL_OF_THEM = 1 << 40
CLAIM = 100_000
HOSTILE = 3e38


class Home:
    """A DEALER speaking as home `home` with that home's key pair."""

    def __init__(self, keys: Path, address: str, home: int) -> None:
        self.home, self.name = home, f"home-{home}"
        pair = CurveKeys.load(keys, "worker", self.name)
        self.ctx: zmq.Context[Any] = zmq.Context()
        server_key = pair.server_key("coordinator", COORDINATOR)
        self.sock = connect_dealer(self.ctx, address, self.name, keys=pair, server_key=server_key)

    def ask(self, msg: Any, tensors: list[torch.Tensor] | None = None) -> Envelope:
        send_message(self.sock, msg, self.name, tensors or [])
        assert self.sock.poll(30_000, zmq.POLLIN), "the federation did not answer"
        return recv_message(self.sock, Limits())[1]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def federation(tmp_path, redis_url, cluster_name) -> Iterator[tuple[LocalCluster, list[Home]]]:
    keys = tmp_path / "keys"
    create_key_set(keys, workers=[f"home-{h}" for h in range(3)])
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = {"federation_id": "f", "model": MODEL, "homes": 3, "updates": 1, "strategy": "fedavg"}
    path = cluster.write("federation.yaml", spec)
    args = ["-m", "services.federation.main", "--bind", address, "--spec", str(path)]
    cluster.spawn("federation", [*args, "--keys", str(keys), "--exit-when-done"])
    homes = [Home(keys, address, h) for h in range(3)]
    try:
        yield cluster, homes
    finally:
        for home in homes:
            home.close()
        cluster.close()


def ok(env: Envelope) -> None:
    assert isinstance(env.msg, FederationReply) and env.msg.ok, env.msg


def accuracy(state: dict[str, torch.Tensor]) -> float:
    net = build_model(ModelSpec.model_validate(MODEL), 0).full()
    net.load_state_dict(state)
    net.eval()
    split = load_digits_split(seed=0)
    with torch.no_grad():
        return float((net(split.test_x).argmax(dim=1) == split.test_y).float().mean())


def test_a_home_claiming_2_40_samples_with_3e38_weights_does_not_take_the_model(
    federation, redis_url, cluster_name
):
    cluster, homes = federation
    reference = build_model(ModelSpec.model_validate(MODEL), 0).full().state_dict()
    hostile = homes[2]
    greedy = JoinFederation(
        federation="f",
        home=2,
        model=ModelSpec.model_validate(MODEL),
        num_samples=ALL_OF_THEM,
        histogram=[ALL_OF_THEM] + [0] * (DIGIT_CLASSES - 1),
    )
    refused = hostile.ask(greedy).msg
    assert isinstance(refused, FederationReply) and not refused.ok
    assert "home 2" in refused.error and "claims 1099511627776 samples" in refused.error
    shares = [home_share(2, h, 1.0, 0, 10) for h in range(2)]
    for home, (_, y) in zip(homes[:2], shares, strict=True):
        histogram = list(label_histogram(y, DIGIT_CLASSES))
        ok(
            home.ask(
                greedy.model_copy(
                    update={"home": home.home, "num_samples": len(y), "histogram": histogram}
                )
            )
        )
    big = greedy.model_copy(update={"num_samples": CLAIM, "histogram": [CLAIM] + [0] * 9})
    ok(hostile.ask(big))
    tasks = [home.ask(FetchModel(federation="f", home=home.home)) for home in homes]
    for task in tasks:
        assert isinstance(task.msg, FederatedModel) and task.msg.status == "train", task.msg
    start = state_from_frame(tasks[0].tensors, reference, "test")
    config = SimConfig(round_times=(1.0,), local_steps=20, lr=0.2)
    net = build_model(ModelSpec.model_validate(MODEL), 0).full()
    honest = []
    for home, task, (x, y) in zip(homes[:2], tasks[:2], shares, strict=True):
        trained = local_train(net, start, x, y, config, torch.Generator().manual_seed(home.home))
        honest.append(trained)
        update = HomeUpdate(
            federation="f",
            home=home.home,
            round_id=task.msg.round_id,
            num_samples=len(y),
            latency_s=1.0,
        )
        ok(home.ask(update, [state_frame(trained)]))
    poison = {
        k: torch.full_like(v, HOSTILE) if v.is_floating_point() else v for k, v in start.items()
    }
    update = HomeUpdate(
        federation="f",
        home=2,
        round_id=tasks[2].msg.round_id,
        num_samples=ALL_OF_THEM,
        latency_s=1.0,
    )
    lying = hostile.ask(update, [state_frame(poison)]).msg
    assert (
        isinstance(lying, FederationReply) and not lying.ok and "joined with 100000" in lying.error
    )
    ok(hostile.ask(update.model_copy(update={"num_samples": CLAIM}), [state_frame(poison)]))
    for home in homes:
        done = home.ask(FetchModel(federation="f", home=home.home))
        assert isinstance(done.msg, FederatedModel) and done.msg.status == "done", done.msg
    assert cluster.wait("federation", 30) == 0
    store = Store(redis_url, cluster_name)
    try:
        blob = store.get_blob("fl-model", "f")
        curve = store.read("fl-metrics", "f")
    finally:
        store.close()
    assert blob is not None
    final = state_from_frame(
        [torch.frombuffer(bytearray(blob), dtype=torch.uint8)], reference, "redis"
    )
    want = fedavg(honest, [len(y) for _, y in shares])
    for key, value in want.items():
        assert torch.allclose(final[key], value, atol=1e-6), key
    assert curve[-1]["version"] == 1
    assert abs(curve[-1]["accuracy"] - accuracy(want)) < 1e-6
    [(home, action, reason)] = curve[-1]["screened"]
    assert (home, action) == (2, "rejected") and "norm" in reason, reason
    log = cluster.log("federation")
    assert "home update screened" in log and "Traceback" not in log
