"""Async without a drain between windows, on real workers, equals its stream replay.

Stages forward the first micro-batches of window r+1 while they finish window
r, so versions run on across windows: the final weights and window losses must
equal `reference_train_async` over one stream from round 0, and differ from a
pipeline drained at every window (the replay with a drain point per round) by
far more than the tolerance. A recovered run restarts the stream at the round
the recovery re-assigned (a drain point) and equals the replay with that drain.
Held-out evaluation between windows runs on the weights at the cut. A
restarted coordinator goes on from its last committed round, another drain point.
"""

from __future__ import annotations

import signal
from typing import Any

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
    reference_train_async,
    weight_difference,
)

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
BATCH = 32
DEPTH4 = [stage(0, 2, "a"), stage(2, 4, "b"), stage(4, 6, "c"), stage(6, 7, "d")]
DRAINED_GAP = 1e-4
"""How far the stream must be from a pipeline drained at every window (weights, max-abs)."""


def _job(jid: str, rounds: int, **extra: Any) -> dict[str, Any]:
    """An async job of these tests (seed 7, plain SGD), with `extra` fields."""
    return {
        "job_id": jid,
        "model": MODEL,
        "seed": 7,
        "rounds": rounds,
        "optimizer": SGD,
        "mode": "async",
        **extra,
    }


@pytest.mark.parametrize(("m", "every", "evaluate"), [(4, 0, True), (8, 3, False)])
def test_a_depth_four_stream_equals_its_replay(
    tmp_path, redis_url, cluster_name, m, every, evaluate
):
    rounds = 4
    job = {"mode": "async", "aggregate_every": every, "checkpoint_every": 1}
    if evaluate:  # between windows, with forwards of the next one in flight
        job |= {"eval_every": 1, "dataset": {"kind": "synthetic", "eval_size": 64}}
    _, weights, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        MODEL,
        DEPTH4,
        rounds=rounds,
        m=m,
        batch=BATCH,
        job_fields=job,
    )
    k0 = Plan.model_validate({"stages": DEPTH4, "global_batch": BATCH, "microbatches": m}).warmup(0)
    dataset = job.get("dataset")
    ref, ref_losses = reference_train_async(
        MODEL, 7, BATCH, m, k0, rounds, SGD, aggregate_every=every, dataset=dataset
    )
    assert_matches_reference(weights, ref)
    assert_losses_match([x["loss"] for x in metrics if "loss" in x], ref_losses)
    drained, _ = reference_train_async(
        MODEL,
        7,
        BATCH,
        m,
        k0,
        rounds,
        SGD,
        aggregate_every=every,
        dataset=dataset,
        drains=range(rounds),
    )
    key, gap = weight_difference(weights, drained)
    assert gap > DRAINED_GAP, f"the stream is only {gap:.3g} (at {key}) from a drained pipeline"
    if evaluate:
        evals = [x for x in metrics if "eval_loss" in x or "eval_accuracy" in x]
        assert len(evals) >= rounds, metrics


def test_a_recovered_stream_equals_its_replay_with_the_recovery_as_drain_point(
    tmp_path, redis_url, cluster_name, budget
):
    """c dies mid-window 2; the survivors and c's replica restart the stream where it holds."""
    m, rounds = 4, 4
    plan = {"global_batch": BATCH, "microbatches": m, "stages": DEPTH4}
    job = _job("nodrain-ft", rounds, aggregate_every=2, elastic=False, adapt=False)
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    store = Store(redis_url, cluster_name)
    try:
        for name in ("a", "b", "c", "d"):
            # micro-batch 2 of window 2: after c's run-ahead of it (K_c - 1 = 2 forwards)
            extra = ["--fail-at", "2:forward:2"] if name == "c" else []
            cluster.spawn(name, ["-m", "services.worker.main", "--device", name, *extra])
            cluster.workers.append(name)
        cluster.start_coordinator(job, plan)
        code = cluster.wait("coordinator", 200)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
        assert cluster.procs["c"].wait(timeout=10) == -9
        weights = load_full_state(store, "nodrain-ft", rounds)
        (event,) = [e for e in store.read("events", "nodrain-ft") if e["event"] == "recovered"]
        losses = [x["loss"] for x in store.read("metrics", "nodrain-ft") if "loss" in x]
    finally:
        cluster.close()
        store.close()
    drain = event["from_round"]
    # c's replica of round 2 leaves as the round starts: if c dies before its backup has it,
    # the survivors roll back to round 1's replicas and replay round 1 (the ledger's rollback)
    assert drain in (1, 2) and event["source"] == "replicas", event
    k_before = Plan.model_validate(plan).warmup(0)
    k_after = min(2 * len(event["stages"]) - 1, m)
    k0s = [k_before] * drain + [k_after] * (rounds - drain)
    ref, ref_losses = reference_train_async(
        MODEL, 7, BATCH, m, k0s, rounds, SGD, aggregate_every=2, drains=(0, drain)
    )
    assert_matches_reference(weights, ref)
    assert_losses_match(losses[:drain] + losses[-(rounds - drain) :], ref_losses)
    unbroken, _ = reference_train_async(MODEL, 7, BATCH, m, k0s, rounds, SGD, aggregate_every=2)
    key, gap = weight_difference(weights, unbroken)
    assert gap > DRAINED_GAP, f"only {gap:.3g} (at {key}) from a replay without the drain point"


def test_a_resumed_stream_equals_its_replay_with_the_resume_as_drain_point(
    tmp_path, redis_url, cluster_name, budget, store
):
    """The coordinator is killed mid-job and resumed: the workers restart the stream there."""
    m, rounds = 4, 8
    plan = {"global_batch": BATCH, "microbatches": m, "stages": DEPTH4}
    job = _job("nodrain-resume", rounds, checkpoint_every=0)
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        for name in ("a", "b", "c", "d"):
            cluster.spawn(name, ["-m", "services.worker.main", "--device", name])
            cluster.workers.append(name)
        cluster.start_coordinator(job, plan)
        cluster.wait_round(store, "nodrain-resume", 3)
        cluster.procs["coordinator"].send_signal(signal.SIGKILL)
        cluster.procs["coordinator"].wait(timeout=10)
        cluster.start_coordinator(job, plan, name="again", resume=True)
        assert cluster.wait("again", budget.left(150)) == ExitCode.OK, cluster.log_tail("again")
        cluster.wait_workers_exit(names=["a", "b", "c", "d"])
    finally:
        cluster.close()
    events = store.read("events", "nodrain-resume")
    drain = [e for e in events if e["event"] == "running"][-1]["round"]
    assert 3 <= drain < rounds, events
    weights = load_full_state(store, "nodrain-resume", rounds)
    losses = {x["round"]: x["loss"] for x in store.read("metrics", "nodrain-resume") if "loss" in x}
    k0 = Plan.model_validate(plan).warmup(0)
    ref, ref_losses = reference_train_async(MODEL, 7, BATCH, m, k0, rounds, SGD, drains=(0, drain))
    assert_matches_reference(weights, ref)
    assert_losses_match([losses[r] for r in range(rounds)], ref_losses)
    unbroken, _ = reference_train_async(MODEL, 7, BATCH, m, k0, rounds, SGD)
    key, gap = weight_difference(weights, unbroken)
    assert gap > DRAINED_GAP, f"only {gap:.3g} (at {key}) from a replay without the drain point"
