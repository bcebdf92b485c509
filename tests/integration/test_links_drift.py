"""Links that get slower while a job runs are measured again, with the single-process result.

Three real worker processes whose data plane turns slow from round
`SLOW_FROM` on (`tests.faulty_worker --fault slow-data`: every activation,
gradient and all-reduce chunk leaves late, as over a slow link; compute and
the bandwidth probes are untouched), a profiler, a planner and a coordinator
on loopback with real Redis. The plan (made on the links measured at the
start) predicts little communication; the workers report far more, round
after round, while their compute holds: the coordinator measures the links
again at a round boundary and asks the planner (a `links_remeasured` event),
once (then it cools down), and the job still ends equal to single-process
training, every round trained once, nothing replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.ledger import effective_rounds
from services.coordinator.adapt import ADAPT_AFTER, PERSIST
from tests.cluster import LocalCluster
from tests.integration.test_recovery import BATCH, DATASET, MODEL, SEED, SGD, job_spec
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

WORKERS = ["a", "b", "c"]
ROUNDS = 10
"""As the other exactness tests: float re-association over so few rounds stays far below 1e-6."""
SLOW_FROM = 2
"""The round from which every worker's data plane is slow (before the speeds' baseline)."""
JOB = "drift"


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], list[float]]:
    return reference_train(MODEL, SEED, BATCH, ROUNDS, SGD, dataset=DATASET)


def test_slower_links_are_measured_again_and_the_job_stays_exact(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
    slow = ["--fault", "slow-data", "--fault-round", str(SLOW_FROM)]
    try:
        cluster.start_workers(WORKERS, faults={name: slow for name in WORKERS})
        cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
        cluster.spawn("planner", ["-m", "services.planner.service"])
        job = job_spec(
            JOB,
            rounds=ROUNDS,
            global_batch=BATCH,
            micro_batch=8,
            min_workers=3,
            checkpoint_every=0,
            adapt=True,
        )
        cluster.start_coordinator(job)
        code = cluster.wait("coordinator", budget.left(300))
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    finally:
        cluster.close()
    events = store.read("events", JOB)
    remeasured = [e for e in events if e["event"] == "links_remeasured"]
    metrics = [m for m in store.read("metrics", JOB) if "devices" in m]
    waits = [max(d["wait_s"] + d["allreduce_s"] for d in m["devices"].values()) for m in metrics]
    plan = store.get_json("plan", JOB)
    why = f"events {events}; waits {waits}; plan {plan}"
    assert len(remeasured) == 1, why  # once: then it cools down
    (event,) = remeasured
    # not before the speeds' baseline and `PERSIST` slow rounds after it
    assert event["round"] >= ADAPT_AFTER + PERSIST - 1, why
    assert event["current_s"] is not None and event["current_s"] > 0, why
    measured = [e for e in cluster.log_events("coordinator") if e.get("event") == "links measured"]
    assert len(measured) == 2, measured  # at the start, and again
    relinked = [e for e in events if e["event"] == "replanned" and e["kind"] == "links"]
    assert len(relinked) == (1 if event["replanned"] else 0), why
    # exact: the weights and losses of single-process training, every round once
    replans = [e for e in events if e["event"] in ("replanned", "links_remeasured")]
    try:
        assert_matches_reference(load_full_state(store, JOB, ROUNDS), reference[0])
    except AssertionError as exc:
        raise AssertionError(f"{exc}; re-plans {replans}") from None
    ledger = effective_rounds(store.read("ledger", JOB))
    assert [e["round"] for e in ledger] == list(range(ROUNDS))
    assert not [e for e in store.read("ledger", JOB) if "rollback_to" in e]  # nothing replayed
    losses = {(m["round"], m["epoch"]): m["loss"] for m in metrics}
    assert_losses_match([losses[(e["round"], e["epoch"])] for e in ledger], reference[1])
