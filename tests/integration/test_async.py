"""`mode: async` on real workers equals its single-process replay (delayed gradients).

Real coordinator and worker processes run a pipeline of single-device stages
in async mode: every micro-batch is updated right after its backward, forwards
run on stashed versions with vertical sync, FTPipeHD's aggregation when asked.
The run is deterministic, so its final weights and window losses must equal
`reference_train_async` (one process, same seed, the first stage's textbook
1F1B order) and must differ from synchronous training by far more than the
tolerance. Checkpoints name the weight version they hold.
"""

from __future__ import annotations

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.plan import Plan
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import SGD, run_job, stage
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_train,
    reference_train_async,
    weight_difference,
)

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
ROUNDS = 3
M = 8
BATCH = 32
STAGES = [stage(0, 2, "a"), stage(2, 5, "b"), stage(5, 7, "c")]
WRONG_SEMANTICS_GAP = 1e-4


@pytest.mark.parametrize("aggregate_every", [0, 5])
def test_async_pipeline_equals_its_single_process_replay(
    tmp_path, redis_url, cluster_name, aggregate_every
):
    job = {"mode": "async", "aggregate_every": aggregate_every, "checkpoint_every": 1}
    _, weights, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        MODEL,
        STAGES,
        rounds=ROUNDS,
        m=M,
        batch=BATCH,
        job_fields=job,
    )
    k0 = Plan.model_validate({"stages": STAGES, "global_batch": BATCH, "microbatches": M}).warmup(0)
    ref, ref_losses = reference_train_async(
        MODEL, 7, BATCH, M, k0, ROUNDS, SGD, aggregate_every=aggregate_every
    )
    assert_matches_reference(weights, ref)
    assert_losses_match([m["loss"] for m in metrics if "loss" in m], ref_losses)
    sync, _ = reference_train(MODEL, 7, BATCH, ROUNDS, SGD)
    key, gap = weight_difference(weights, sync)
    assert gap > WRONG_SEMANTICS_GAP, f"async is only {gap:.3g} (at {key}) from sync training"
    store = Store(redis_url, cluster_name)
    try:
        per_window = M + (M // aggregate_every if aggregate_every else 0)
        for r in range(1, ROUNDS + 1):
            manifest = store.get_json("ckpt", "eq", r, "manifest")
            assert manifest["version"] == r * per_window, manifest
    finally:
        store.close()


def test_async_refuses_a_data_parallel_stage_by_name(tmp_path, redis_url, cluster_name):
    with pytest.raises(AssertionError, match="single-device stages; stage 0 has 2 devices"):
        run_job(
            tmp_path,
            redis_url,
            cluster_name,
            MODEL,
            [stage(0, 4, "a", "b"), stage(4, 7, "c")],
            rounds=1,
            job_fields={"mode": "async"},
        )


def test_an_async_pipeline_recovers_a_lost_stage_and_replays_its_window(
    tmp_path, redis_url, cluster_name, budget
):
    """b dies mid-window; its replica (on c) and the survivors resume from the window start.

    The re-planned pipeline has one stage less, so K_0 and with it every later
    micro-batch's version change: the replay is compared with a reference that
    uses the new K_0 from the recovered window on.
    """
    plan = {"global_batch": BATCH, "microbatches": M, "stages": STAGES}
    job = {
        "job_id": "async-ft",
        "model": MODEL,
        "seed": 7,
        "rounds": 4,
        "optimizer": SGD,
        "mode": "async",
        "aggregate_every": 4,
        "elastic": False,
        "adapt": False,
    }
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    store = Store(redis_url, cluster_name)
    try:
        for name in ("a", "b", "c"):
            extra = ["--fail-at", "2:forward:4"] if name == "b" else []
            cluster.spawn(name, ["-m", "services.worker.main", "--device", name, *extra])
            cluster.workers.append(name)
        cluster.start_coordinator(job, plan)
        code = cluster.wait("coordinator", 200)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
        assert cluster.procs["b"].wait(timeout=10) == -9
        weights = load_full_state(store, "async-ft", 4)
        (event,) = [e for e in store.read("events", "async-ft") if e["event"] == "recovered"]
        losses = [m["loss"] for m in store.read("metrics", "async-ft") if "loss" in m]
    finally:
        cluster.close()
        store.close()
    # b's replica of round 2 leaves as the round starts: if b dies before its backup has it,
    # the survivors roll back to round 1's replicas and replay round 1
    drain = event["from_round"]
    assert drain in (1, 2) and event["source"] == "replicas", event
    k_before = Plan.model_validate(plan).warmup(0)
    k_after = min(2 * len(event["stages"]) - 1, M)
    k0s = [k_before] * drain + [k_after] * (4 - drain)
    ref, ref_losses = reference_train_async(
        MODEL, 7, BATCH, M, k0s, 4, SGD, aggregate_every=4, drains=(0, drain)
    )
    assert_matches_reference(weights, ref)
    assert_losses_match(losses[:drain] + losses[-(4 - drain) :], ref_losses)
