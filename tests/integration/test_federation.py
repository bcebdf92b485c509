"""Three real homes federate through `asteroid-federation` on scikit-learn's digits.

Each home is a cluster of its own (coordinator and workers as processes, its own
Redis key prefix); home 0 pipelines its model over two devices. The homes train
their Dirichlet shares of digits, send models, receive the federation's. Held-out
accuracy of the global model rises, and the global model the federation stores is,
bit for bit within float tolerance, the plain sample-weighted average (FedAvg) of
the models the homes' last local jobs checkpointed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from safetensors.torch import load_file
from typer.testing import CliRunner

from common.checkpoint import load_full_state
from common.codec import Limits, recv_message, send_message
from common.curve import COORDINATOR, CurveKeys, create_key_set
from common.exit_codes import ExitCode
from common.federation_messages import FederationReply, FetchModel
from common.fl.data import home_share
from common.fl.wire import state_from_frame
from common.messages import CancelJob
from common.ports import free_port
from common.sockets import connect_dealer
from common.store import Store
from common.zoo import ModelSpec, build_model
from services.cli import app
from services.cli.client import ask_coordinator
from services.federation.aggregate import fedavg
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import stage

pytestmark = pytest.mark.integration

MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 16, "hidden": 64},
}
HOMES = 3
JOB_SEED = 0
OPTIMIZER: dict[str, Any] = {"kind": "sgd", "lr": 0.3, "momentum": 0.0}
BATCH = 32
ALPHA = 0.5
LOCAL_ROUNDS = 10
UPDATES = 12
ECO_UPDATES = 16
PLANS = [
    [stage(0, 2, "h0a"), stage(2, 4, "h0b")],  # a two-device pipeline
    [stage(0, 4, "h1a")],
    [stage(0, 4, "h2a")],
]


def digits(home: int) -> dict[str, Any]:
    """Home `home`'s share of the digits, as its job spec names it."""
    return {"kind": "digits", "homes": HOMES, "home": home, "alpha": ALPHA}


class Federated:
    """A federation service and three homes, each its own LocalCluster."""

    def __init__(self, tmp: Path, redis_url: str, name: str, budget: Budget) -> None:
        self.name = name
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.homes = [
            LocalCluster(tmp / f"home{h}", redis_url, f"{name}-h{h}", budget=budget)
            for h in range(HOMES)
        ]
        for h, home in enumerate(self.homes):
            (tmp / f"home{h}").mkdir()
            home.env["ASTEROID_HEARTBEAT_S"] = "0.3"
        self.server = LocalCluster(tmp, redis_url, f"{name}-fed", budget=budget)

    def start(
        self,
        strategy: str,
        updates: int,
        *,
        keys: Path | None = None,
        faults: dict[str, list[str]] | None = None,
        homes: tuple[int, ...] = tuple(range(HOMES)),
        **spec_fields: Any,
    ) -> None:
        """The federation, then `homes`; `faults` as `LocalCluster.start_workers`'s."""
        spec = {
            "federation_id": "digits",
            "model": MODEL,
            "seed": 1,
            "homes": HOMES,
            "strategy": strategy,
            "updates": updates,
            "round_timeout_s": 120,
            **spec_fields,
        }
        path = self.server.write("federation.yaml", spec)
        args = ["-m", "services.federation.main", "--bind", self.address, "--spec", str(path)]
        if keys is not None:
            args += ["--keys", str(keys)]
        self.args = [*args, "--exit-when-done"]
        self.server.spawn("federation", self.args)
        for h in homes:
            home = self.homes[h]
            devices = [a["device"] for s in PLANS[h] for a in s["devices"]]
            home.start_workers(devices, faults)
            job = {
                "job_id": "learn",
                "model": MODEL,
                "seed": JOB_SEED,
                "rounds": LOCAL_ROUNDS,
                "global_batch": BATCH,
                "micro_batch": BATCH // 2,
                "optimizer": OPTIMIZER,
                "dataset": digits(h),
                "federation": {
                    "federation_id": "digits",
                    "address": self.address,
                    "home": h,
                    "timeout_s": 120,
                    "keys": None if keys is None else str(keys),
                },
            }
            plan = {"global_batch": BATCH, "microbatches": 2, "stages": PLANS[h]}
            home.start_coordinator(job, plan)

    def wait(self, timeout_s: float = 240) -> None:
        for h, home in enumerate(self.homes):
            code = home.wait("coordinator", timeout_s)
            assert code == 0, f"home {h} exited {code}:\n{home.log_tail('coordinator', 60)}"
        code = self.server.wait("federation", 60)
        assert code == 0, self.server.log_tail("federation", 60)

    def curve(self) -> list[dict[str, Any]]:
        """The federation's fl-metrics entries: one per ended round, version 0 first."""
        store = Store(self.server.env["ASTEROID_REDIS_URL"], f"{self.name}-fed")
        try:
            return store.read("fl-metrics", "digits")
        finally:
            store.close()

    def close(self) -> None:
        for cluster in [*self.homes, self.server]:
            with contextlib.suppress(Exception):
                cluster.close()


@pytest.fixture
def federated(tmp_path, redis_url, cluster_name, budget) -> Iterator[Federated]:
    fed = Federated(tmp_path, redis_url, cluster_name, budget)
    try:
        yield fed
    finally:
        fed.close()


def test_three_homes_federate_and_fedavg_is_the_weighted_mean(federated, redis_url, tmp_path):
    federated.start("fedavg", updates=UPDATES)
    federated.wait()
    store = Store(redis_url, f"{federated.name}-fed")
    try:
        curve = federated.curve()
        versions = [e["version"] for e in curve]
        assert versions == list(range(UPDATES + 1)), versions
        assert all(e["failed"] == [] for e in curve[1:])
        first, last = curve[0]["accuracy"], curve[-1]["accuracy"]
        assert last > first + 0.4, [e["accuracy"] for e in curve]
        assert store.get_fields("fl", "digits")["state"] == "finished"
        model = build_model(ModelSpec.model_validate(MODEL), 1).full()
        reference = model.state_dict()
        blob = store.get_blob("fl-model", "digits")
        assert blob is not None
        final = state_from_frame(
            [torch.frombuffer(bytearray(blob), dtype=torch.uint8)], reference, "redis"
        )
    finally:
        store.close()
    # the last update is the weighted mean of each home's last local job
    states, sizes = [], []
    for h in range(HOMES):
        home_store = Store(redis_url, f"{federated.name}-h{h}")
        try:
            states.append(load_full_state(home_store, f"learn.r{UPDATES - 1}", LOCAL_ROUNDS))
            assert home_store.get_fields("job", "learn")["state"] == "finished"
        finally:
            home_store.close()
        sizes.append(len(home_share(HOMES, h, ALPHA, 0, 10)[1]))
    expected = fedavg(states, sizes)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-6, atol=1e-7)
    # what an operator sees, and the model file plain PyTorch loads
    out = tmp_path / "global.safetensors"
    args = ["federation", "digits", "--redis-url", redis_url, "--cluster", f"{federated.name}-fed"]
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"finished, version {UPDATES}" in res.output and "rounds (last" in res.output
    model.load_state_dict(load_file(out))
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[key])


def _ask_as(keys_dir: Path, key: str, address: str, msg: Any, wait_s: float = 30) -> Any:
    """Send `msg` to the federation with pair `key` of the key set; its reply or None.

    Under a routing identity of its own: taking the running home's (`home-N`) would
    hand its route over to this socket (ROUTER_HANDOVER) and cut the home off.
    """
    pair = CurveKeys.load(keys_dir, "worker", key)
    ctx: zmq.Context[Any] = zmq.Context()
    server_key = pair.server_key("coordinator", COORDINATOR)
    sock = connect_dealer(ctx, address, f"{key}/probe", keys=pair, server_key=server_key)
    try:
        send_message(sock, msg, key)
        if not sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return None
        return recv_message(sock, Limits())[1].msg
    finally:
        sock.close(0)
        ctx.term()


def test_ecofl_over_curve_regroups_a_home_that_slows_down(federated, tmp_path):
    keys = tmp_path / "fedkeys"
    create_key_set(keys, workers=[f"home-{h}" for h in range(HOMES)] + ["stranger"])
    stranger = keys / "workers" / "stranger.key"
    # home 2's device slows from its 4th local job on: its latency leaves its group's band
    faults = {"h2a": ["--fault", "slow-rounds", "--fault-round", "4"]}
    # one group of all homes, a wide band (3x): loopback's timing noise never leaves it,
    # a round 10 x 0.5 s slower does, and no other group can take the home in
    federated.start("ecofl", ECO_UPDATES, keys=keys, faults=faults, groups=1, rt_fraction=2.0)
    # a key of the set that is not a home's is admitted by CURVE and refused by name
    claim = FetchModel(federation="digits", home=1)
    reply = _ask_as(keys, "stranger", federated.address, claim)
    assert isinstance(reply, FederationReply) and not reply.ok
    assert "not home 1's" in reply.error
    # home 2's key speaking as home 1 is refused the same way
    reply = _ask_as(keys, "home-2", federated.address, claim)
    assert isinstance(reply, FederationReply) and not reply.ok and "home-2" in reply.error
    # a key outside the set gets no answer at all (the handshake fails)
    stranger.unlink()
    (keys / "workers" / "stranger.key_secret").rename(tmp_path / "stranger.key_secret")
    outside = tmp_path / "outside"
    (outside / "workers").mkdir(parents=True)
    (outside / "coordinator").mkdir()
    (tmp_path / "stranger.key_secret").rename(outside / "workers" / "stranger.key_secret")
    for public in (keys / "coordinator").glob("*.key"):
        (outside / "coordinator" / public.name).write_bytes(public.read_bytes())
    assert _ask_as(outside, "stranger", federated.address, claim, wait_s=3) is None
    federated.wait()
    curve = federated.curve()
    assert curve[-1]["version"] == ECO_UPDATES
    assert curve[-1]["accuracy"] > curve[0]["accuracy"] + 0.25, [e["accuracy"] for e in curve]
    events = [(e["version"], tuple(r)) for e in curve[1:] for r in e["regroups"]]
    assert (2, "drop", None) in [r for _, r in events], events
    # it stays out: its rounds stay slow (a busy machine may push a fast home out and back)
    assert (2, "rejoin", 0) not in [r for _, r in events], events
    dropped_at = next(v for v, r in events if r == (2, "drop", None))
    assert dropped_at >= 3  # its first three local jobs ran at full speed, inside the band
    # once out, its rounds are probes: they measure it, the global model does not change
    probes = [e for e in curve if e.get("group", 0) is None and e["members"] == [2]]
    assert probes
    versions = [e["version"] for e in curve]
    for e in probes:
        before = versions[curve.index(e) - 1]
        assert e["version"] == before


def test_the_federation_goes_on_when_a_home_leaves(federated):
    # rounds of all homes; the one home 2 never finishes ends at the round timeout
    federated.server.env["ASTEROID_DONE_GRACE_S"] = "2"
    federated.start("fedavg", 6, round_timeout_s=8)
    deadline = time.monotonic() + 120
    while not any(e["version"] >= 2 for e in federated.curve()):
        assert time.monotonic() < deadline, federated.server.log_tail("federation")
        time.sleep(0.1)
    killed_at = federated.curve()[-1]["version"]
    home = federated.homes[2]
    for name in ("coordinator", "h2a"):
        os.killpg(home.procs[name].pid, signal.SIGKILL)
    for h in (0, 1):
        code = federated.homes[h].wait("coordinator", 180)
        assert code == 0, federated.homes[h].log_tail("coordinator", 40)
    assert federated.server.wait("federation", 60) == 0
    curve = federated.curve()
    assert curve[-1]["version"] == 6
    # every round after it left ended at the timeout without it (on a busy machine a
    # live home may miss a deadline too: its late update is refused as stale)
    gone = [e for e in curve if e["version"] > killed_at + 1]
    assert gone and all(2 in e["failed"] and e["members"] == [0, 1, 2] for e in gone), gone


def test_a_home_waiting_for_the_others_can_be_cancelled(federated, redis_url):
    federated.start("fedavg", 3, homes=(0,))  # homes 1 and 2 never come: home 0 waits
    home = federated.homes[0]
    deadline = time.monotonic() + 90
    while "home joined" not in federated.server.log("federation"):
        assert time.monotonic() < deadline, home.log_tail("coordinator")
        time.sleep(0.2)
    reply = ask_coordinator(home.addr, CancelJob(job_id="learn", reason="enough"), 30)
    assert reply.ok, reply.error
    assert home.wait("coordinator", 60) == ExitCode.JOB_FAILED
    assert _state(redis_url, f"{federated.name}-h0", "learn") == "cancelled"


def _state(redis_url: str, cluster: str, job: str) -> str:
    store = Store(redis_url, cluster)
    try:
        return str(store.get_fields("job", job).get("state", ""))
    finally:
        store.close()


def test_a_restarted_federation_continues_where_it_stopped(federated):
    federated.start("fedavg", 8)
    deadline = time.monotonic() + 120
    while not any(e["version"] >= 3 for e in federated.curve()):
        assert time.monotonic() < deadline, federated.server.log_tail("federation")
        time.sleep(0.05)
    os.killpg(federated.server.procs["federation"].pid, signal.SIGKILL)
    federated.server.procs["federation"].wait(10)
    stopped_at = federated.curve()[-1]["version"]
    federated.server.spawn("federation2", federated.args)  # same spec, no --replace
    for h, home in enumerate(federated.homes):
        code = home.wait("coordinator", 180)
        assert code == 0, f"home {h}:\n{home.log_tail('coordinator', 40)}"
    assert federated.server.wait("federation2", 60) == 0
    assert "federation resumed" in federated.server.log("federation2")
    curve = federated.curve()
    versions = [e["version"] for e in curve]
    assert versions == list(range(9)), versions  # nothing lost, nothing merged twice
    after = [e for e in curve if e["version"] > stopped_at]
    assert after and all(e["round_id"] >= 1 << 32 for e in after)  # the new run's rounds
    assert curve[-1]["accuracy"] > curve[0]["accuracy"] + 0.2
