"""Each way a job can fail ends it with an error that names the cause, and nothing hangs.

Real coordinator, worker and profiler processes on loopback, real Redis. Each
test asserts the error the job recorded in Redis, the coordinator's exit code
and its "job failed" log line; timeouts are made small through settings so
the failures come quickly.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Any

import pytest
import torch
from torch import nn

from common.exit_codes import ExitCode
from common.store import Store
from common.zoo import model_factory
from tests.cluster import LocalCluster
from tests.faulty_worker import STALL_EVENT
from tests.integration.test_equivalence import stage

pytestmark = pytest.mark.integration

MLP = {"name": "mlp", "options": {"hidden": 16, "depth": 2}}
"""Three small layers: every failure here is about control, not compute."""

PIPELINE = {"global_batch": 8, "microbatches": 2, "stages": [stage(0, 2, "a"), stage(2, 3, "b")]}
GROUP = {"global_batch": 12, "microbatches": 2, "stages": [stage(0, 3, "a", "b", "c")]}


SLEEP_S = 4.0
"""How long each forward of `slow_to_profile`'s middle layer takes: more than its profile may."""


class _Sleep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return x


@model_factory
def unprofilable() -> nn.Sequential:
    """A model that builds (the coordinator accepts it) but whose second layer cannot run."""
    return nn.Sequential(nn.Flatten(), nn.Linear(10, 10))


@model_factory
def slow_to_profile() -> nn.Sequential:
    """A model every forward of which takes `SLEEP_S`: its profile cannot be quick."""
    return nn.Sequential(nn.Flatten(), _Sleep(), nn.Linear(3 * 32 * 32, 10))


def _job(job_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "model": MLP,
        "seed": 1,
        "rounds": 3,
        "dataset": {"kind": "synthetic", "eval_size": 8},
        **extra,
    }


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget):
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    yield c
    c.close()


def _coordinator(
    cluster: LocalCluster, name: str, job: dict[str, Any], *flags: str
) -> subprocess.Popen[bytes]:
    """A coordinator running `job` with `flags` (LocalCluster's own always passes a plan)."""
    spec = str(cluster.write(f"{name}.yaml", job))
    args = ["-m", "services.coordinator.main", "--bind", cluster.addr, "--job", spec, *flags]
    return cluster.spawn(name, args)


def _failed(cluster: LocalCluster, store: Store, name: str, job_id: str) -> str:
    """The error job `job_id` failed with, checked against the coordinator's exit and log."""
    code = cluster.wait(name, 90)
    assert code == ExitCode.JOB_FAILED, (code, cluster.log(name))
    record = store.get_fields("job", job_id)
    assert record.get("state") == "failed", (record, cluster.log(name))
    logged = [e["error"] for e in cluster.log_events(name) if e.get("event") == "job failed"]
    assert logged == [record["error"]], cluster.log(name)
    return str(record["error"])


def _wait_logged(cluster: LocalCluster, name: str, event: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e.get("event") == event for e in cluster.log_events(name)):
        assert time.monotonic() < deadline, f"{name} did not log {event!r}:\n{cluster.log(name)}"
        time.sleep(0.1)


def test_join_timeout_and_min_workers_shortfall_name_who_is_missing(cluster, store):
    cluster.env["ASTEROID_JOIN_TIMEOUT_S"] = "2"
    cluster.start_workers(["a"])
    _wait_logged(cluster, "a", "worker started")

    plan = str(cluster.write("plan.json", PIPELINE))
    _coordinator(cluster, "coord-plan", _job("join"), "--plan", plan)
    error = _failed(cluster, store, "coord-plan", "join")
    assert error == "workers ['b'] did not join within 2 s (joined: ['a'])"

    job = _job("few", global_batch=8, min_workers=2)
    _coordinator(cluster, "coord-planned", job)
    error = _failed(cluster, store, "coord-planned", "few")
    assert (
        error
        == "min_workers: 2 workers wanted, 1 joined and vetted within 2 s (['a']; left out: none)"
    )


def test_a_round_that_never_ends_fails_at_the_round_timeout(cluster, store):
    # b's data-plane sends stop from round 1 while it heartbeats; the workers would
    # wait for them for a minute, the coordinator for a round only 3 s
    cluster.env.update({"ASTEROID_TASK_TIMEOUT_S": "60", "ASTEROID_ROUND_TIMEOUT_S": "3"})
    cluster.start_workers(["a", "b"], faults={"b": ["--fault", "cut-data", "--fault-round", "1"]})
    cluster.start_coordinator(_job("slow"), PIPELINE)
    error = _failed(cluster, store, "coordinator", "slow")
    # b is the last stage: it has what it needs; a waits for b's gradients
    assert error == "no RoundDone of round 1 from ['a'] within 3 s"
    assert store.get_fields("job", "slow")["round"] == 1
    cluster.wait_workers_exit(names=["a", "b"])  # their rounds were blocked on the data plane


def test_a_cut_data_link_fails_the_job_at_the_task_timeout(cluster, store):
    # the control plane stays up, so only the workers' own wait can notice
    cluster.env["ASTEROID_TASK_TIMEOUT_S"] = "3"
    cluster.start_workers(["a", "b"], faults={"a": ["--fault", "cut-data", "--fault-round", "1"]})
    cluster.start_coordinator(_job("cut"), PIPELINE)
    error = _failed(cluster, store, "coordinator", "cut")
    # both sides of the link wait for each other; whichever gives up first is reported
    assert error in (
        "worker a failed in round 1: RoundTimeoutError: waited 3 s for gradients of "
        "micro-batches [0, 1] from stage 1",
        "worker b failed in round 1: RoundTimeoutError: waited 3 s for activations of "
        "micro-batch 0 from stage 0",
    )
    assert store.get_fields("job", "cut")["round"] == 1
    cluster.wait_workers_exit(names=["a", "b"])


def test_an_error_inside_a_round_fails_the_job_naming_the_worker(cluster, store):
    fail = ["--fault", "fail-round", "--fault-stage", "1", "--fault-round", "1"]
    cluster.start_workers(["a", "b"], faults={"b": fail})
    cluster.start_coordinator(_job("err"), PIPELINE)
    error = _failed(cluster, store, "coordinator", "err")
    assert error == (
        "worker b failed in round 1: RuntimeError: injected fault in round 1 on stage 1"
    )
    assert store.get_fields("job", "err")["round"] == 1
    cluster.wait_workers_exit(names=["a", "b"])  # a's round waited for b's gradients


def test_a_member_killed_mid_all_reduce_fails_the_job_and_its_peers_recover(cluster, store):
    cluster.env["ASTEROID_TASK_TIMEOUT_S"] = "8"  # its closed connections tell it well before
    stall = ["--fault", "stall-allreduce", "--fault-round", "1"]
    cluster.start_workers(["a", "b", "c"], faults={"b": stall})
    plan = str(cluster.write("plan.json", GROUP))
    # workers stay; recovery none: the job fails, and the survivors recover by themselves
    _coordinator(cluster, "coordinator", _job("dp", recovery="none"), "--plan", plan)
    _wait_logged(cluster, "b", STALL_EVENT)
    cluster.procs["b"].send_signal(signal.SIGKILL)  # a and c wait in the all-reduce for b

    error = _failed(cluster, store, "coordinator", "dp")
    # its closed connections name it (the coordinator's own, its neighbours'), long before
    # a heartbeat deadline
    assert error.startswith(
        "workers ['b'] lost while the coordinator waited for RoundDone of round 1: "
        "b: control connection closed"
    ), error
    assert store.get_fields("job", "dp")["round"] == 1
    # nobody tells the survivors: their own task timeout ends the all-reduce
    for name in ("a", "c"):
        _wait_logged(cluster, name, "command failed", timeout_s=30)
        failed = [e for e in cluster.log_events(name) if e.get("event") == "command failed"]
        assert len(failed) == 1 and failed[0]["round"] == 1, failed
        assert "RoundTimeoutError: waited 8 s for reduce chunk" in failed[0]["exception"]
    # and they serve the next job, a group of the two of them
    again = {**GROUP, "stages": [stage(0, 3, "a", "c")]}
    plan = str(cluster.write("again.json", again))
    _coordinator(cluster, "again", _job("after", rounds=2), "--plan", plan)
    assert cluster.wait("again", 90) == ExitCode.OK, cluster.log("again")


def test_profiler_failure_timeout_and_no_planner_name_the_service(cluster, store):
    here = __name__
    # quick profiles; this module's factories are allowed as an operator would allow theirs
    cluster.env.update(
        {"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0", "ASTEROID_MODEL_MODULES": here}
    )
    cluster.start_workers(["a"])
    profiler = cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
    name = f"profiler-{socket.gethostname()}-{profiler.pid}"

    job = _job("broken", model={"name": f"{here}:unprofilable"}, global_batch=2, micro_batch=1)
    _coordinator(cluster, "coord-broken", job)
    error = _failed(cluster, store, "coord-broken", "broken")
    assert error == (
        f"profiling for worker a failed on {name}: layer 1 failed on a batch of 1: "
        "mat1 and mat2 shapes cannot be multiplied (1x3072 and 10x10)"
    )

    # profiled, then nobody plans it
    job = _job("unplanned", global_batch=2, micro_batch=1)
    _coordinator(cluster, "coord-unplanned", job, "--plan-timeout-s", "1")
    error = _failed(cluster, store, "coord-unplanned", "unplanned")
    assert error == (
        f"no planner service joined within 1 s (start asteroid-planner with --coordinator "
        f"{cluster.addr})"
    )
    events = [e["event"] for e in store.read("events", "unplanned")]
    assert events == ["submitted", "profiling", "planning", "failed"]

    fingerprint = store.get_fields("device", "a")["fingerprint"]
    job = _job("slow", model={"name": f"{here}:slow_to_profile"}, global_batch=2, micro_batch=1)
    _coordinator(cluster, "coord-slow", job, "--profile-timeout-s", "3")
    error = _failed(cluster, store, "coord-slow", "slow")
    assert error == f"{name} did not send the profile of {fingerprint} within 3 s"
