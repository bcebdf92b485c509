"""No state is destroyed by accident, and no job id becomes a Redis pattern.

Attacks from the issue: a SubmitJob (or CancelJob) whose job_id is ``*`` sent over a
real DEALER to a coordinator process, and re-running ``asteroid-coordinator --job``
for an existing job without ``--resume``. Another job's checkpoints must survive both,
byte for byte; only an operator's ``--replace`` deletes a job's state.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.job import JobSpec, check_job_id
from common.messages import CancelJob, SubmitJob
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.security.attacker import alive, serving_coordinator

JOB = JobSpec.model_validate({"job_id": "probe", "model": {"name": "mlp"}})
ONE = stage(0, 4, "a")
"""The whole four-layer mlp on worker a (which never joins)."""


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget):
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    yield c
    c.close()


def finished_job(store: Store, jid: str) -> dict[bytes, bytes]:
    """Leave what a finished run of `jid` leaves: record, metrics, checkpoint of round 3."""
    store.set_fields({"state": "finished", "round": 3, "total_rounds": 3}, "job", jid)
    store.append("metrics", jid, {"round": 2, "loss": 0.5})
    store.put_blob(b"weights of " + jid.encode(), "ckpt", jid, 3, "layer", 0)
    store.put_json({"layers": 1}, "ckpt", jid, 3, "manifest")
    store.r.set(store.key("ckpt", jid, "latest"), 3)
    return snapshot(store, jid)


def snapshot(store: Store, jid: str) -> dict[bytes, bytes]:
    """Every string key of job `jid`'s checkpoints with its value, to compare later."""
    keys = sorted(store.keys("ckpt", jid, ""))
    return {k: store.r.get(k) or b"" for k in keys}


# --- ids and the store, in-process ------------------------------------------------


@pytest.mark.parametrize("jid", ["a", "job-1", "resnet18_cifar.v2", "A" * 64, "0"])
def test_ordinary_job_ids_pass(jid: str):
    assert check_job_id(jid) == jid
    assert JobSpec.model_validate({"job_id": jid, "model": {"name": "mlp"}}).job_id == jid


@pytest.mark.parametrize(
    "jid",
    ["*", "a*", "a?", "[ab]", "a\\b", "a:b", "", " a", "-a", ".a", "a b", "é", "A" * 65, 7, None],
)
def test_job_ids_outside_the_pattern_are_refused_naming_the_sender(jid: Any):
    with pytest.raises(ConfigError) as info:
        check_job_id(jid, "peer mallory")
    assert str(info.value).startswith("job_id from peer mallory: expected 1-64 letters")
    assert repr(jid) in str(info.value)
    with pytest.raises(ValueError, match="job_id"):
        JobSpec.model_validate({"job_id": jid, "model": {"name": "mlp"}})


def test_delete_prefix_takes_its_parts_literally_not_as_a_pattern(store: Store):
    before = {jid: finished_job(store, jid) for jid in ("a", "b", "a1")}
    assert store.delete_prefix("ckpt", "*", "") == 0
    assert store.delete_prefix("ckpt", "?", "") == 0
    assert store.delete_prefix("ckpt", "[ab]", "") == 0
    assert list(store.keys("ckpt", "*")) == []
    assert {jid: snapshot(store, jid) for jid in before} == before
    # the literal prefix is exact: job "a" is not a prefix of job "a1"
    assert store.delete_prefix("ckpt", "a", "") == 4
    assert snapshot(store, "a") == {}
    assert snapshot(store, "a1") == before["a1"] and snapshot(store, "b") == before["b"]


def test_keys_with_glob_characters_are_found_by_their_literal_prefix(store: Store):
    store.r.set(store.key("odd", "x*y", "1"), 1)
    store.r.set(store.key("odd", "xzy", "1"), 1)
    assert [k.decode() for k in store.keys("odd", "x*y", "")] == [store.key("odd", "x*y", "1")]
    assert store.delete_prefix("odd", "x*y", "") == 1
    assert store.r.exists(store.key("odd", "xzy", "1"))


# --- over the wire, against a coordinator process --------------------------------------


@pytest.mark.integration
def test_job_id_star_deletes_nothing_and_is_refused_naming_the_field(cluster, store):
    victims = {jid: finished_job(store, jid) for jid in ("victim", "other")}
    attacker = serving_coordinator(cluster)
    try:
        reply = attacker.ask(SubmitJob(job=JOB, replace=True), job__job_id="*")
        assert not reply.ok
        assert reply.error.startswith("invalid 'submit_job' message: String should match"), reply
        assert reply.error.endswith(" at submit_job.job.job_id"), reply
        alive(cluster)
        reply = attacker.ask(CancelJob(job_id="x"), job_id="*")
        assert not reply.ok
        assert reply.error.startswith("invalid 'cancel_job' message: String should match"), reply
        assert reply.error.endswith(" at cancel_job.job_id"), reply
        alive(cluster)
        # an existing id is refused without replace, and keeps its state
        reply = attacker.ask(SubmitJob(job=JOB), job__job_id="victim")
        assert reply.error == (
            "job_id: job victim exists (finished); pick another job_id, or submit with "
            "--replace to delete its checkpoints and metrics and start afresh"
        ), reply
        alive(cluster)
    finally:
        attacker.close()
    assert {jid: snapshot(store, jid) for jid in victims} == victims
    assert store.read("metrics", "victim") == [{"round": 2, "loss": 0.5}]


def _run_job(cluster: LocalCluster, name: str, jid: str, *flags: str) -> int:
    """Run `asteroid-coordinator --job` for `jid` on a one-worker plan; its exit code."""
    job = {**JOB.model_dump(mode="json"), "job_id": jid, "global_batch": 2}
    spec = cluster.write(f"{name}.yaml", job)
    plan = cluster.write(f"{name}.json", {"global_batch": 2, "microbatches": 1, "stages": [ONE]})
    args = ["--bind", cluster.addr, "--job", str(spec), "--plan", str(plan), *flags]
    cluster.spawn(name, ["-m", "services.coordinator.main", *args])
    return cluster.wait(name, 60)


@pytest.mark.integration
def test_rerunning_a_job_without_resume_or_replace_deletes_nothing(cluster, store):
    cluster.env["ASTEROID_JOIN_TIMEOUT_S"] = "1"  # no workers: a job that starts fails fast
    victim = finished_job(store, "victim")
    code = _run_job(cluster, "again", "victim")
    assert code == ExitCode.CONFIG, cluster.log("again")
    logged = [e for e in cluster.log_events("again") if e.get("event") == "invalid job"]
    assert [e["error"] for e in logged] == [
        "job_id: job victim exists (finished); pick another job_id, or --replace to delete "
        "its checkpoints and metrics and start afresh"
    ], cluster.log("again")
    assert snapshot(store, "victim") == victim
    assert store.read("metrics", "victim") == [{"round": 2, "loss": 0.5}]
    assert store.get_fields("job", "victim")["state"] == "finished"

    # the operator's --replace is what deletes them (the job then starts and, with no
    # worker to run it, fails)
    code = _run_job(cluster, "replaced", "victim", "--replace")
    assert code == ExitCode.JOB_FAILED, cluster.log("replaced")
    assert snapshot(store, "victim") == {}
    assert store.read("metrics", "victim") == []
    assert store.get_fields("job", "victim")["state"] == "failed"
