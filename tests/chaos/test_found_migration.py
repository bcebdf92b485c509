"""Found by a chaos run: a survivor waiting for a migration from a device that dies meanwhile.

A recovery (or re-plan) assigns a survivor layers that a peer sends it; that
peer dies before it sends them (a second failure while the first is being
recovered). The coordinator detects it and assigns again without it, but the
survivor's main thread was still blocked gathering the first assignment's
layers, so it did not take the new one until its task timeout (120 s by
default) ran out: the whole job stood still that long. Seen in the seeded
chaos run (seed 4: a stage and its backup killed, then a third device while
that recovery was under way).

Reproduced on real processes: c (which holds b's replica, so a recovery of b
has it send layers) dies the first time an assignment asks it to send layers
(`tests.faulty_worker --fault die-sending`); b is killed mid-round. The task
timeout is set far past the test's budget, so only a survivor that gives up
the stale migration when the newer assignment arrives lets the job finish.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.ledger import effective_rounds
from common.store import Store
from tests.cluster import Budget, LocalCluster
from tests.faulty_worker import DIE_EVENT
from tests.integration.test_recovery import BATCH, DATASET, MODEL, PLAN, ROUNDS, SEED, SGD, job_spec
from tests.reference import assert_matches_reference, reference_train

pytestmark = pytest.mark.integration


def test_a_survivor_drops_a_migration_whose_sender_died_when_assigned_again(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget, store: Store
) -> None:
    reference, _ = reference_train(MODEL, SEED, BATCH, ROUNDS, SGD, dataset=DATASET)
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env["ASTEROID_TASK_TIMEOUT_S"] = "900"  # longer than the test: no wait may run out
    try:
        for name in ("a", "d"):
            cluster.spawn(name, ["-m", "services.worker.main", "--device", name])
            cluster.workers.append(name)
        cluster.spawn(
            "b", ["-m", "services.worker.main", "--device", "b", "--fail-at", "3:forward"]
        )
        cluster.spawn("c", ["-m", "tests.faulty_worker", "--fault", "die-sending", "--device", "c"])
        cluster.start_coordinator(job_spec("moot", checkpoint_every=2), PLAN)
        code = cluster.wait("coordinator", budget.left(200))
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
        cluster.wait_workers_exit(names=["a", "d"])
    finally:
        cluster.close()
    assert any(e.get("event") == DIE_EVENT for e in cluster.log_events("c")), cluster.log_tail("c")
    assert_matches_reference(load_full_state(store, "moot", ROUNDS), reference)
    assert [e["round"] for e in effective_rounds(store.read("ledger", "moot"))] == list(
        range(ROUNDS)
    )
