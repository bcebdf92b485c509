"""Held-out evaluation through a hybrid pipeline of real worker processes.

A small driver plays the coordinator: evaluation before training, three
rounds, evaluation, one more round. Summed loss and correct predictions equal
the single-process reference's evaluation of the same weights on the same
held-out samples, and the round after the evaluation still matches the
reference, so evaluation changed nothing. A RunEval for weights the workers do
not hold is answered with a WorkerError by every worker.
"""

from __future__ import annotations

import pytest

from common.checkpoint import check_replicas, commit_checkpoint, load_full_state, save_stage
from common.job import JobSpec
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    EvalDone,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
    Shutdown,
    WorkerError,
)
from common.plan import Plan
from common.store import Store
from common.zoo import build_model
from tests.cluster import LocalCluster
from tests.integration.driver import Driver
from tests.integration.test_equivalence import PLANS
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_eval,
    reference_train,
)

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
OPT = {
    "kind": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "schedule": {"kind": "step", "step_rounds": 2, "gamma": 0.5, "warmup_rounds": 1},
}
HELD_OUT = {"kind": "synthetic", "eval_size": 100}
ROUNDS = 4
EPOCH = 1


def test_eval_through_hybrid_pipeline_matches_reference(tmp_path, redis_url, cluster_name, budget):
    job = JobSpec.model_validate(
        {
            "job_id": "ev",
            "model": MODEL,
            "seed": 7,
            "rounds": ROUNDS,
            "optimizer": OPT,
            "dataset": HELD_OUT,
        }
    )
    plan = Plan(global_batch=32, microbatches=4, stages=PLANS["hybrid"])
    devices = [str(d) for d in plan.devices]
    last = [str(a.device) for a in plan.stages[-1].devices]
    leaders = [str(st.devices[0].device) for st in plan.stages]
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    driver = Driver(cluster.addr, budget)
    store = Store(redis_url, cluster_name)

    def evaluate(round_no, batches):
        driver.send(devices, RunEval(epoch=EPOCH, round=round_no, batches=batches))
        done = driver.gather(EvalDone, devices, EPOCH, round_no)
        assert {d: m.stage for d, m in done.items()} == {d: plan.stage_of(d) for d in devices}
        per_stage = [
            sum(m.samples for m in done.values() if m.stage == p) for p in range(len(plan.stages))
        ]
        assert len(set(per_stage)) == 1, per_stage  # every stage saw every sample once
        return (
            sum(done[d].loss_sum for d in last),
            sum(done[d].correct for d in last),
            sum(done[d].samples for d in last),
        )

    def train(round_no):
        driver.send(devices, RunRound(epoch=EPOCH, round=round_no))
        done = driver.gather(RoundDone, devices, EPOCH, round_no)
        return sum(done[d].loss_sum for d in last)

    try:
        cluster.start_workers(devices)
        peers = driver.wait_for(devices)
        full = build_model(job.model, job.seed).full()
        save_stage(store, "ev", 0, full, None, 0)
        commit_checkpoint(store, "ev", 0, len(full))
        for d in devices:
            assign = Assign(
                epoch=EPOCH,
                job=job,
                plan=plan,
                stage=plan.stage_of(d),
                peers=peers,
                from_round=0,
                total_rounds=ROUNDS,
            )
            driver.send([d], assign)
        driver.gather(Assigned, devices, EPOCH, 0)
        initial = evaluate(0, 1)
        losses = [train(r) for r in range(3)]
        after_three = evaluate(3, 4)  # 128 positions cover the 100 held-out samples once
        losses.append(train(3))
        driver.send(devices, SaveCheckpoint(epoch=EPOCH, round=ROUNDS))
        saved = driver.gather(CheckpointSaved, devices, EPOCH, ROUNDS)
        digests = [
            {str(a.device): saved[str(a.device)].digest for a in st.devices} for st in plan.stages
        ]
        check_replicas(ROUNDS, digests)  # every replica holds its leader's state, bit for bit
        written = {d: m.layers for d, m in saved.items() if m.layers}
        assert written == {
            d: list(range(st.start, st.end)) for d, st in zip(leaders, plan.stages, strict=True)
        }
        commit_checkpoint(store, "ev", ROUNDS, len(full), digests)
        weights = load_full_state(store, "ev", ROUNDS)
        driver.send(devices, RunEval(epoch=EPOCH, round=2, batches=1))
        refused = driver.gather(WorkerError, devices, EPOCH, 2)
        driver.send(devices, Shutdown(reason="test over"))
        cluster.wait_workers_exit()
    finally:
        driver.close()
        store.close()
        cluster.close()

    assert all("holds those of round 4" in m.error for m in refused.values())
    ref_final, ref_losses = reference_train(MODEL, 7, 32, ROUNDS, OPT, dataset=HELD_OUT)
    ref_three, _ = reference_train(MODEL, 7, 32, 3, OPT, dataset=HELD_OUT, total_rounds=ROUNDS)
    assert_matches_reference(weights, ref_final)
    assert_losses_match(losses, ref_losses)
    for got, ref_weights, count in [
        (initial, full.state_dict(), 32),
        (after_three, ref_three, 128),
    ]:
        loss, correct, samples = reference_eval(MODEL, 7, ref_weights, count, dataset=HELD_OUT)
        assert got[0] == pytest.approx(loss, rel=1e-4)
        assert got[1:] == (correct, samples)
