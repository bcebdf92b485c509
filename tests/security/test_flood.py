"""No heartbeat flood starves the coordinator, grows its memory or litters Redis.

Attack from the issue: 50,000 heartbeats from one made-up id, then heartbeats from
3,000 more made-up ids, each over a plain DEALER with frames built by
`common.codec.encode`, sent to a real coordinator process that runs a real job on
real workers. Before the fix every heartbeat was a Redis write, `pump` drained them
all before looking at any deadline, and every fake id stayed in memory and in Redis
forever.

The coordinator waits for its last worker while the flood arrives, so the fake
devices expire while it runs (a short expiry through the environment); then the
last worker joins and the job trains under a second flood to the single-process
reference. What the coordinator did with the heartbeats is read from its
"heartbeat counts" log lines.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common.checkpoint import load_full_state
from common.codec import encode
from common.ids import DeviceId
from common.messages import Heartbeat
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.membership import Verdict
from services.coordinator.service import PUMP_MAX_MESSAGES, Coordinator
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import SGD, stage
from tests.reference import assert_matches_reference, reference_train

MODEL = {"name": "small_cnn"}
STAGES = [stage(0, 3, "a"), stage(3, 7, "b", "c")]
ROUNDS = 5
REAL = ["a", "b", "c"]
CAP = 100
"""Most unassigned devices the coordinator remembers (ASTEROID_MAX_UNASSIGNED_DEVICES)."""
ONE_ID_BEATS = 50_000
FAKE_IDS = 3_000
EXPIRY_S = 6.0
"""Longer than LocalCluster's 0.3 s heartbeat times the 6 misses a worker is dead after, and
than the fake ids take to arrive behind the flood, so none expires before the last arrives."""


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    c.env["ASTEROID_DEVICE_EXPIRY_S"] = str(EXPIRY_S)
    c.env["ASTEROID_MAX_UNASSIGNED_DEVICES"] = str(CAP)
    c.env["ASTEROID_JOIN_TIMEOUT_S"] = "200"
    yield c
    c.close()


def dealer(ctx: zmq.Context[Any], address: str, name: str) -> zmq.Socket[Any]:
    """A plain DEALER under routing id `name`, as anyone on the LAN can open."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{name}/{secrets.token_hex(8)}".encode())
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 10_000)  # a closed socket still delivers what it sent
    sock.connect(address)
    return sock


def beat(name: str) -> list[Any]:
    """The frames of one heartbeat that device `name` sends about itself."""
    return encode(Heartbeat(device=name, data_addr="tcp://127.0.0.1:9"), name)


def flood_one_id(ctx: zmq.Context[Any], address: str, name: str, count: int) -> None:
    """`count` heartbeats from one made-up id, as fast as the socket takes them."""
    sock = dealer(ctx, address, name)
    frames = beat(name)
    for _ in range(count):
        sock.send_multipart(frames)
    sock.close()


def flood_many_ids(ctx: zmq.Context[Any], address: str, count: int, batch: int = 100) -> None:
    """One heartbeat from each of `count` made-up ids, `batch` sockets open at a time."""
    for start in range(0, count, batch):
        socks = [dealer(ctx, address, f"fake-{i}") for i in range(start, start + batch)]
        for i, sock in enumerate(socks, start):
            sock.send_multipart(beat(f"fake-{i}"))
        for sock in socks:
            sock.close()


def counts(cluster: LocalCluster) -> list[dict[str, Any]]:
    """The coordinator's "heartbeat counts" log lines so far."""
    return [e for e in cluster.log_events("coordinator") if e.get("event") == "heartbeat counts"]


def devices_in_redis(store: Store) -> set[str]:
    """Device names that have a `device:<name>` key."""
    return {k.decode().rsplit(":", 1)[1] for k in store.keys("device", "")}


def wait_until(
    cluster: LocalCluster, done: Any, what: str, cap_s: float, state: Any = lambda: ""
) -> None:
    """Poll `done()` until true; fail naming `what` and `state()`, with the coordinator's log."""
    deadline = time.monotonic() + cluster.budget.left(cap_s)
    while not done():
        code = cluster.procs["coordinator"].poll()
        assert code is None, f"coordinator exited with {code}:\n{cluster.log('coordinator')}"
        assert time.monotonic() < deadline, (
            f"{what} did not happen ({cluster.budget}); {state()}; last counts "
            f"{(counts(cluster) or [{}])[-1]}:\n{cluster.log_tail('coordinator', 20)}"
        )
        time.sleep(0.2)


def joined(cluster: LocalCluster, names: list[str]) -> bool:
    seen = {e.get("worker") for e in cluster.log_events("coordinator")}
    return set(names) <= seen


@pytest.fixture
def coord(redis_url: str, cluster_name: str) -> Iterator[Coordinator]:
    """An in-process coordinator whose devices expire 0.2 s after their last heartbeat."""
    settings = CoordinatorSettings(
        bind=f"tcp://127.0.0.1:{free_port()}",
        redis_url=redis_url,
        cluster=cluster_name,
        heartbeat_s=0.05,
        heartbeat_misses=2,
        device_expiry_s=0.2,
    )
    c = Coordinator(settings)
    yield c
    c.close()


def pump_until(coord: Coordinator, done: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        coord.pump(0.05)


def test_one_pump_call_handles_a_bounded_batch_of_a_flood(coord):
    ctx: zmq.Context[Any] = zmq.Context()
    beats = 20_000
    try:
        flood_one_id(ctx, coord.endpoint, "flood", beats)

        def count() -> int:
            member = coord.members.get(DeviceId("flood"))
            return 0 if member is None else member.beats

        per_call = []
        deadline = time.monotonic() + 60
        while (before := count()) < beats:
            assert time.monotonic() < deadline, f"only {before} of {beats} heartbeats arrived"
            coord.pump(0.05)
            per_call.append(count() - before)
    finally:
        ctx.destroy(linger=0)
    # the caller got control back (to look at its deadlines) at least every batch
    assert max(per_call) <= PUMP_MAX_MESSAGES, max(per_call)
    assert sum(per_call) == beats
    assert coord.heartbeat_counts[Verdict.JOINED] == 1
    # one Redis write at once, then at most one a second: far fewer than the beats
    assert coord.heartbeat_counts[Verdict.LIMITED] >= beats - 1 - 60, coord.heartbeat_counts


def test_an_expired_device_loses_exactly_its_own_key(coord):
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        real, glob = dealer(ctx, coord.endpoint, "a"), dealer(ctx, coord.endpoint, "*")
        coord.running, coord.assigned = "job", frozenset({"a"})  # a runs a job: kept
        real.send_multipart(beat("a"))
        glob.send_multipart(beat("*"))
        pump_until(coord, lambda: {"a", "*"} <= set(coord.members), "both heartbeats")
        assert devices_in_redis(coord.store) == {"a", "*"}
        # "*" falls silent and expires; "a" is silent too but assigned to the running job
        pump_until(coord, lambda: "*" not in coord.members, "expiry of *")
        assert devices_in_redis(coord.store) == {"a"} and set(coord.members) == {"a"}
        assert coord.heartbeat_counts["expired"] == 1
        # between jobs nothing is kept: a silent a expires as well
        coord.running = None
        pump_until(coord, lambda: not coord.members, "expiry of a")
        assert devices_in_redis(coord.store) == set()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.integration
def test_heartbeat_floods_neither_stall_the_job_nor_leave_state_behind(cluster, store):
    job = {"job_id": "flood", "model": MODEL, "seed": 7, "rounds": ROUNDS, "optimizer": SGD}
    plan = {"global_batch": 32, "microbatches": 4, "stages": STAGES}
    cluster.start_workers(["a", "b"])
    cluster.start_coordinator(job, plan)
    wait_until(cluster, lambda: joined(cluster, ["a", "b"]), "workers a and b joining", 60)

    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * FAKE_IDS)  # closed sockets linger until they delivered
    try:
        # while the coordinator waits for worker c: one id floods, then 3,000 ids arrive
        flood_one_id(ctx, cluster.addr, "flood", ONE_ID_BEATS)
        flood_many_ids(ctx, cluster.addr, FAKE_IDS)

        def all_fakes_handled_and_forgotten() -> bool:
            last = (counts(cluster) or [{}])[-1]
            handled = last.get("joined", 0) + last.get("dropped", 0)
            # a, b and "flood" joined; each fake id either joined or was dropped
            return (
                handled == 3 + FAKE_IDS
                and last.get("expired") == last.get("joined", 0) - 2
                and devices_in_redis(store) == {"a", "b"}
            )

        wait_until(
            cluster,
            all_fakes_handled_and_forgotten,
            "expiry of every fake id",
            120,
            lambda: f"{len(devices_in_redis(store))} device keys in Redis",
        )
        last = counts(cluster)[-1]
        assert last["dropped"] >= FAKE_IDS - CAP, last  # the cap held while they came
        assert last["limited"] >= ONE_ID_BEATS - 1_000, last  # one Redis write a second
        assert max(c["known"] for c in counts(cluster)) <= CAP + 2, counts(cluster)
        drops = [e for e in cluster.log_events("coordinator") if e["event"].startswith("dropped")]
        assert drops[0]["peer"].startswith("fake-"), drops[0]

        # the last worker joins and the job trains while another id floods
        stop = threading.Event()

        def keep_flooding() -> None:
            sock = dealer(ctx, cluster.addr, "flood-2")
            frames = beat("flood-2")
            for _ in range(200):  # at most 100,000 heartbeats
                if stop.is_set():
                    break
                for _ in range(500):
                    sock.send_multipart(frames)
                stop.wait(0.02)
            sock.close()

        flooder = threading.Thread(target=keep_flooding, daemon=True)
        flooder.start()
        cluster.start_workers(["c"])
        try:
            code = cluster.wait("coordinator", 180)
        finally:
            stop.set()
            flooder.join(timeout=30)
    finally:
        ctx.destroy(linger=0)  # everything was delivered: the coordinator counted it

    assert code == 0, cluster.log("coordinator")
    assert not flooder.is_alive()
    cluster.wait_workers_exit()
    assert store.get_fields("job", "flood")["state"] == "finished"
    ref, _ = reference_train(MODEL, 7, 32, ROUNDS, SGD)
    assert_matches_reference(load_full_state(store, "flood", ROUNDS), ref)
    assert counts(cluster)[-1]["limited"] > last["limited"], counts(cluster)[-1]
