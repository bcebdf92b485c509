"""The coordinator restarts without losing the job, and a replaced one is fenced off.

A coordinator is SIGKILLed mid-job and started again with `--resume`: it raises
the fence in Redis, reads the job, its plan and the rounds committed, and the
workers (never restarted) keep their stage state of that round, so the job goes
on from there: the final weights equal single-process training and every
committed round appears exactly once in the metrics stream. Workers say in their
log that the coordinator went away and keep trying to reach it. A command
stamped with an older coordinator's fence is refused by a worker's control link.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.checkpoint import load_full_state
from common.codec import Limits, encode
from common.exit_codes import ExitCode
from common.messages import Heartbeat, Probe, Shutdown
from common.sockets import bind_router
from services.worker.control import ControlLink
from tests.cluster import LocalCluster
from tests.integration.test_recovery import DATASET, MODEL, PLAN, ROUNDS, SEED, SGD, WORKERS
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration


def test_a_restarted_coordinator_goes_on_from_the_last_committed_round(
    tmp_path: Path, redis_url, cluster_name, budget, store
):
    reference = reference_train(MODEL, SEED, 32, ROUNDS, SGD, dataset=DATASET)
    job = {
        "job_id": "restart",
        "model": MODEL,
        "seed": SEED,
        "rounds": ROUNDS,
        "optimizer": SGD,
        "dataset": DATASET,
        "checkpoint_every": 0,  # only round 0 in Redis: going on from it would replay
    }
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        for name in WORKERS:
            cluster.spawn(name, ["-m", "services.worker.main", "--device", name])
            cluster.workers.append(name)
        cluster.start_coordinator(job, PLAN)
        deadline = time.monotonic() + budget.left(120)
        while int(store.get_fields("job", "restart").get("round", 0)) < 3:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.01)
        cluster.procs["coordinator"].send_signal(signal.SIGKILL)
        cluster.procs["coordinator"].wait(timeout=10)
        committed = int(store.get_fields("job", "restart")["round"])
        first_fence = int(store.r.get(store.key("fence")) or 0)
        cluster.start_coordinator(job, PLAN, name="again", resume=True)
        assert cluster.wait("again", budget.left(150)) == ExitCode.OK, cluster.log_tail("again")
        cluster.wait_workers_exit(names=WORKERS)
    finally:
        cluster.close()
    assert int(store.r.get(store.key("fence")) or 0) == first_fence + 1
    assert_matches_reference(load_full_state(store, "restart", ROUNDS), reference[0])
    losses = {m["round"]: m["loss"] for m in store.read("metrics", "restart") if "loss" in m}
    rounds = [m["round"] for m in store.read("metrics", "restart") if "loss" in m]
    assert sorted(rounds) == list(range(ROUNDS)), rounds  # each committed round once
    assert_losses_match([losses[r] for r in range(ROUNDS)], reference[1])
    events = store.read("events", "restart")
    assert not [e for e in events if e["event"] in ("recovered", "recovering")], events
    resumed = [e for e in events if e["event"] == "running"][-1]
    assert resumed["round"] == committed >= 3, resumed
    for name in WORKERS:
        logged = [e.get("event") for e in cluster.log_events(name)]
        assert logged.count("worker started") == 1, name  # never restarted
        assert "lost the coordinator; trying to reach it again" in logged, name


def test_a_worker_refuses_commands_of_an_older_coordinator() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits())
    link = ControlLink(
        ctx,
        endpoint,
        "w",
        Limits(),
        0.1,
        lambda: Heartbeat(device="w", data_addr="tcp://127.0.0.1:1"),
        lambda _: None,
    )
    link.start()
    try:
        assert router.poll(10_000), "the worker never heartbeated"
        ident = router.recv_multipart()[0]
        # the current coordinator (fence 7), then one that was replaced (fence 6)
        router.send_multipart([ident, *encode(Shutdown(reason="newer"), "coordinator", fence=7)])
        router.send_multipart([ident, *encode(Shutdown(reason="older"), "coordinator", fence=6)])
        router.send_multipart([ident, *encode(Probe(nonce=1), "coordinator", fence=6)])
        got = link.inbox.get(timeout=10)
        assert (got.msg, got.fence) == (Shutdown(reason="newer"), 7)
        time.sleep(0.5)
        assert link.inbox.empty()  # the older coordinator's command never reached the worker
        assert link.fence == 7
    finally:
        link.close()
        router.close(0)
        ctx.destroy(linger=0)
