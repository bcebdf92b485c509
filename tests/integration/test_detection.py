"""Detection with real processes: a stopped worker is lost after its probe, a hung one by
the watchdog, and a throttled straggler that heartbeats and progresses is never failed.

Real coordinator and worker processes on loopback, real Redis. Jobs run with
`recovery: none`, so a lost device ends the job and its recorded error says
which device and why.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from datetime import datetime
from typing import Any

import pytest

from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import LocalCluster
from tests.faulty_worker import STALL_EVENT
from tests.integration.test_equivalence import stage
from tests.integration.test_failure_paths import MLP, PIPELINE

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.3
MISSES = 6
PROBE_S = 1.0
ROUNDS = 30
FREE_ROUNDS = 6
"""Rounds before the straggler is throttled: their time is what it is slowed against."""
STRAGGLER_PLAN = {
    "global_batch": 64,
    "microbatches": 4,
    "stages": [stage(0, 4, "a"), stage(4, 7, "b")],
}
STRAGGLER_OPTIMIZER = {"lr": 0.01}
"""SGD that trains small_cnn on synthetic data without diverging for twice ROUNDS: at the
default lr of 0.05 (momentum 0.9) its loss leaves 0.87 at round 21 and reaches 7e19 at
round 30, the held-out activations turn nan and the worker rightly refuses to send them."""
GROUP = {"global_batch": 12, "microbatches": 2, "stages": [stage(0, 3, "a", "b", "c")]}


def _job(job_id: str, rounds: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "model": MLP,
        "seed": 1,
        "rounds": rounds,
        "dataset": {"kind": "synthetic", "eval_size": 8},
        "recovery": "none",
    }


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget):
    c = LocalCluster(tmp_path, redis_url, cluster_name, heartbeat_s=HEARTBEAT_S, budget=budget)
    c.env.update(
        {
            "ASTEROID_HEARTBEAT_MISSES": str(MISSES),
            "ASTEROID_PROBE_TIMEOUT_S": str(PROBE_S),
            "ASTEROID_TASK_TIMEOUT_S": "60",  # longer than any detection here
        }
    )
    yield c
    c.close()


def _failed(cluster: LocalCluster, store: Store, job_id: str) -> str:
    """The error job `job_id` failed with, checked against the coordinator's exit and log."""
    code = cluster.wait("coordinator", 90)
    assert code == ExitCode.JOB_FAILED, (code, cluster.log("coordinator"))
    record = store.get_fields("job", job_id)
    assert record.get("state") == "failed", (record, cluster.log("coordinator"))
    logged = [e["error"] for e in cluster.log_events("coordinator") if e["event"] == "job failed"]
    assert logged == [record["error"]], cluster.log("coordinator")
    return str(record["error"])


def _logged_at(cluster: LocalCluster, event: str) -> list[tuple[float, dict[str, Any]]]:
    """Wall-clock times (and records) of the coordinator's `event` log lines."""
    return [
        (datetime.fromisoformat(e["timestamp"]).timestamp(), e)
        for e in cluster.log_events("coordinator")
        if e.get("event") == event
    ]


def test_a_stopped_worker_is_probed_then_declared_lost(cluster, store):
    cluster.start_workers(["a", "b"])
    cluster.start_coordinator(_job("stopped", rounds=100_000), PIPELINE)
    cluster.wait_round(store, "stopped", 2)
    b = cluster.procs["b"]
    os.killpg(b.pid, signal.SIGSTOP)  # alive to the kernel, silent to everyone
    stopped_at = time.time()
    try:
        error = _failed(cluster, store, "stopped")
    finally:
        os.killpg(b.pid, signal.SIGCONT)
    match = re.fullmatch(
        r"workers \['b'\] missed heartbeats for ([0-9.]+) s and did not answer a probe within "
        r"1 s while the coordinator waited for RoundDone of round ([0-9]+)",
        error,
    )
    assert match, error
    deadline_s = HEARTBEAT_S * MISSES
    assert deadline_s + PROBE_S <= float(match[1]) < deadline_s + PROBE_S + 1.0, error
    probes = [e for _, e in _logged_at(cluster, "probing suspect")]
    assert [e["device"] for e in probes] == ["b"], cluster.log("coordinator")
    ((failed_at, _),) = _logged_at(cluster, "job failed")
    # within the heartbeat deadline plus the probe timeout, plus slack for a loaded machine
    assert failed_at - stopped_at < deadline_s + PROBE_S + 2.0
    # the stopped worker resumes, answers too late, and is told to shut down with the other
    cluster.wait_workers_exit(names=["a", "b"])


def _throttle(
    pid: int, stop: threading.Event, cycles: list[int], run_s: float = 0.1, pause_s: float = 0.2
) -> None:
    """Let process group `pid` run a third of the time, as a CPU quota of 1/3 core would."""
    while not stop.is_set():
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(pause_s)
        os.killpg(pid, signal.SIGCONT)
        time.sleep(run_s)
        cycles.append(1)


def test_a_throttled_straggler_that_heartbeats_and_progresses_is_not_failed(cluster, store):
    # a watchdog of 1 s, far below the default: standing still for a second would fail b
    cluster.env["ASTEROID_HUNG_MIN_S"] = "1"
    cluster.start_workers(["a", "b"])
    job = {
        **_job("slow", rounds=ROUNDS),
        "model": {"name": "small_cnn"},
        "optimizer": STRAGGLER_OPTIMIZER,
    }
    cluster.start_coordinator(job, STRAGGLER_PLAN)
    cluster.wait_round(store, "slow", FREE_ROUNDS)
    b = cluster.procs["b"]
    stop = threading.Event()
    cycles: list[int] = []
    throttle = threading.Thread(target=_throttle, args=(b.pid, stop, cycles), daemon=True)
    throttle.start()
    try:
        code = cluster.wait("coordinator", 120)
    finally:
        stop.set()
        throttle.join(timeout=5)
        os.killpg(b.pid, signal.SIGCONT)
    assert code == ExitCode.OK, cluster.log("coordinator")
    assert store.get_fields("job", "slow")["state"] == "finished"
    rounds = [m for m in store.read("metrics", "slow") if "round_s" in m]
    assert len(rounds) == ROUNDS
    # the job trained rather than diverged: every loss, the held-out one too, is finite
    assert all(math.isfinite(m["loss"]) for m in rounds), rounds
    (evaluated,) = [m for m in store.read("metrics", "slow") if "eval_loss" in m]
    assert math.isfinite(evaluated["eval_loss"]), evaluated
    # b really was a straggler: stopped for 0.2 s of every 0.3 s, many times over
    # (how much slower its rounds got is a benchmark's business, not a test's)
    assert len(cycles) >= 10, len(cycles)
    cluster.wait_workers_exit(names=["a", "b"])


def test_a_hung_worker_is_found_by_the_watchdog_and_its_waiting_peers_are_not(cluster, store):
    # b stops before its all-reduce in round 1 while it heartbeats; a and c wait for it there
    cluster.env["ASTEROID_HUNG_MIN_S"] = "3"
    stall = ["--fault", "stall-allreduce", "--fault-round", "1"]
    cluster.start_workers(["a", "b", "c"], faults={"b": stall})
    cluster.start_coordinator(_job("hung", rounds=5), GROUP)
    error = _failed(cluster, store, "hung")
    assert error == "worker b heartbeats but made no progress for 3 s in round 1 (watchdog)"
    assert any(e.get("event") == STALL_EVENT for e in cluster.log_events("b"))
    assert int(store.get_fields("job", "hung")["round"]) == 1
    assert _logged_at(cluster, "probing suspect") == []  # b never stopped heartbeating
    # told to shut down, the stalled worker and its waiting peers all leave
    cluster.wait_workers_exit(names=["a", "b", "c"])
