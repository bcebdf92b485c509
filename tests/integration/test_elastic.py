"""Devices join and leave on purpose while a job runs, with exactly the single-process result.

Drain: `asteroid drain c` (a DrainDevice request) moves c's work to the others at
the next round boundary, peer to peer, with nothing replayed; c's process stays
and is let go. Join: a worker that registers while a job planned by the planner
runs is taken in at a round boundary (planned again with it, its layers sent by
their holders). Both on real processes, sockets and Redis; the final weights and
per-round losses equal single-process training from the same seed, and the
ledger shows every round once.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.ids import DeviceId
from common.ledger import effective_rounds
from common.messages import DrainDevice
from common.store import Store
from services.cli.client import ask_coordinator
from tests.cluster import LocalCluster
from tests.integration.test_recovery import (
    BATCH,
    DATASET,
    MODEL,
    PLAN,
    ROUNDS,
    SEED,
    SGD,
    WORKERS,
    job_spec,
)
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], list[float]]:
    return reference_train(MODEL, SEED, BATCH, ROUNDS, SGD, dataset=DATASET)


def _worker(cluster: LocalCluster, name: str) -> None:
    cluster.spawn(name, ["-m", "services.worker.main", "--device", name])
    cluster.workers.append(name)


def _check_exact(
    store: Store, jid: str, reference: tuple[dict[str, Any], list[float]]
) -> dict[str, Any]:
    """Weights and losses equal the reference, every round once; returns the replanned event."""
    assert_matches_reference(load_full_state(store, jid, ROUNDS), reference[0])
    ledger = effective_rounds(store.read("ledger", jid))
    assert [e["round"] for e in ledger] == list(range(ROUNDS))
    assert not [e for e in store.read("ledger", jid) if "rollback_to" in e]  # nothing replayed
    metrics = {(m["round"], m["epoch"]): m for m in store.read("metrics", jid) if "loss" in m}
    assert_losses_match([metrics[(e["round"], e["epoch"])]["loss"] for e in ledger], reference[1])
    (event,) = [e for e in store.read("events", jid) if e["event"] == "replanned"]
    assert event["replayed"] == 0, event
    return event


@pytest.mark.parametrize("leaving", ["c", "b"], ids=["shares-its-stage", "alone-in-its-stage"])
def test_a_drained_device_leaves_at_a_round_boundary_and_nothing_is_replayed(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference, leaving
):
    """c shares its stage with d, who keeps its layers; b alone has its own: it hands them over."""
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        for name in WORKERS:
            _worker(cluster, name)
        cluster.start_coordinator(job_spec("drain", checkpoint_every=0), PLAN)
        cluster.wait_round(store, "drain", 3)
        reply = ask_coordinator(cluster.addr, DrainDevice(target=DeviceId(leaving)), 15.0)
        assert reply.ok and reply.job_id == "drain", reply
        refused = ask_coordinator(cluster.addr, DrainDevice(target=DeviceId("zz")), 15.0)
        assert not refused.ok and "device 'zz' runs no part of a job here" in refused.error
        assert cluster.wait("coordinator", budget.left(120)) == ExitCode.OK
        cluster.wait_workers_exit(names=WORKERS)  # the drained one too: let go, not killed
    finally:
        cluster.close()
    event = _check_exact(store, "drain", reference)
    assert (event["kind"], event["left"]) == ("drain", [leaving]), event
    assert all(leaving not in devs for _, _, devs in event["stages"])
    # only layers that changed hands moved (a drained device sends, it is not lost)
    old = {
        layer: [a["device"] for a in st["devices"]]
        for st in PLAN["stages"]
        for layer in range(st["start"], st["end"])
    }
    new = {layer: devs for lo, hi, devs in event["stages"] for layer in range(lo, hi)}
    changed = sum(d not in old[layer] for layer, devs in new.items() for d in devs)
    assert event["moved_layers"] == changed, event


def test_a_worker_that_registers_during_the_job_is_taken_in(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
    try:
        # d starts first (torch imported, ready) and is stopped before any coordinator
        # listens, so it registers only once continued: while the job runs
        _worker(cluster, "d")
        _logged(cluster, "d", "worker started", budget)
        cluster.procs["d"].send_signal(signal.SIGSTOP)
        for name in ("a", "b", "c"):
            _worker(cluster, name)
        cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
        cluster.spawn("planner", ["-m", "services.planner.service"])
        job = job_spec(
            "join",
            global_batch=BATCH,
            micro_batch=8,
            min_workers=3,
            checkpoint_every=0,
            adapt=False,  # on a loaded machine speeds jump: only the join may re-plan here
        )
        cluster.start_coordinator(job)
        deadline = time.monotonic() + budget.left(150)
        while store.get_fields("job", "join").get("state") != "running":
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.02)
        first = store.get_json("plan", "join")
        cluster.procs["d"].send_signal(signal.SIGCONT)
        code = cluster.wait("coordinator", budget.left(150))
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    finally:
        cluster.close()
    assert "d" not in [a["device"] for st in first["stages"] for a in st["devices"]]
    event = _check_exact(store, "join", reference)
    assert (event["kind"], event["joined"]) == ("join", ["d"]), event
    assert event["from_round"] >= 1, event  # taken in at a round boundary of the running job
    final = store.get_json("plan", "join")
    assert "d" in [a["device"] for st in final["stages"] for a in st["devices"]], final


def _logged(cluster: LocalCluster, name: str, event: str, budget: Any) -> None:
    deadline = time.monotonic() + budget.left(60)
    while not any(e.get("event") == event for e in cluster.log_events(name)):
        assert time.monotonic() < deadline, cluster.log_tail(name)
        time.sleep(0.05)
