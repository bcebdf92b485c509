"""A whole plan's stage runners in one process: schedule, routing and evaluation.

Compared with the single-process reference: training under a learning-rate
schedule, held-out evaluation through a hybrid plan, and evaluation leaving
weights, batch-norm statistics and train mode exactly as they were.
"""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import stage_digest
from common.errors import AsteroidError, RoundTimeoutError
from common.job import JobSpec
from common.plan import Plan
from common.zoo import ModelSpec, build_model
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_eval,
    reference_train,
)
from tests.worker.local_pipeline import LocalPipeline

SMALL_CNN = {"name": "small_cnn"}
COSINE = {
    "kind": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    # one warm-up round: see tests/integration/test_lr_schedule.py on near-ties
    "schedule": {"kind": "cosine", "warmup_rounds": 1, "min_lr": 0.005},
}
# stage 0 = 2 devices splitting 5:3, stage 1 = 1 device, stage 2 = 2 devices 1:1
HYBRID = [
    {"start": 0, "end": 3, "devices": [{"device": "a", "share": 5}, {"device": "b", "share": 3}]},
    {"start": 3, "end": 5, "devices": [{"device": "c"}]},
    {"start": 5, "end": 7, "devices": [{"device": "d"}, {"device": "e"}]},
]
HELD_OUT = {"kind": "synthetic", "eval_size": 100}


def pipeline(store, model, stages, optimizer, rounds, **kw):
    job = JobSpec.model_validate(
        {
            "job_id": "local",
            "model": model,
            "seed": 7,
            "rounds": rounds,
            "optimizer": optimizer,
            "dataset": HELD_OUT,
        }
    )
    plan = Plan(global_batch=32, microbatches=4, stages=stages)
    return LocalPipeline(store, job, plan, **kw)


def summed(pipe, results):
    last = pipe.last_stage()
    return (
        sum(results[d].loss_sum for d in last),
        sum(results[d].correct for d in last),
        sum(results[d].samples for d in last),
    )


@pytest.mark.parametrize("total_rounds", [0, 4], ids=["from-job-spec", "from-assign"])
def test_hybrid_schedule_and_evaluation_match_the_reference(store, total_rounds):
    rounds = 4 if total_rounds == 0 else 9  # Assign.total_rounds wins over the spec
    pipe = pipeline(store, SMALL_CNN, HYBRID, COSINE, rounds, total_rounds=total_rounds)
    initial = pipe.weights()
    first = summed(pipe, pipe.run("run_eval", 0, 1))
    losses = []
    for r in range(3):
        done = pipe.run("run_round", r)
        losses.append(sum(done[d].loss_sum for d in pipe.last_stage()))
    before = pipe.weights()
    second = summed(pipe, pipe.run("run_eval", 3, 4))  # 128 positions, 100 held-out samples
    assert_matches_reference(pipe.weights(), before, tol=0.0, what="weights after evaluation")
    done = pipe.run("run_round", 3)
    losses.append(sum(done[d].loss_sum for d in pipe.last_stage()))
    assert pipe.out.dropped == []

    ref_final, ref_losses = reference_train(SMALL_CNN, 7, 32, 4, COSINE, dataset=HELD_OUT)
    ref_three, _ = reference_train(SMALL_CNN, 7, 32, 3, COSINE, dataset=HELD_OUT, total_rounds=4)
    assert_matches_reference(pipe.weights(), ref_final)
    assert_matches_reference(before, ref_three, what="weights after three rounds")
    assert_losses_match(losses, ref_losses)
    for got, weights, count in [(first, initial, 32), (second, ref_three, 128)]:
        loss, correct, samples = reference_eval(SMALL_CNN, 7, weights, count, dataset=HELD_OUT)
        assert got[0] == pytest.approx(loss, rel=1e-4)
        assert got[1:] == (correct, samples)
    assert second[2] == 100


def test_evaluation_leaves_weights_batchnorm_statistics_and_train_mode(store):
    model = {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}
    n = len(build_model(ModelSpec.model_validate(model), 7).layers)
    stages = [
        {"start": 0, "end": n // 2, "devices": [{"device": "a"}]},
        {"start": n // 2, "end": n, "devices": [{"device": "b"}]},
    ]
    opt = {"kind": "sgd", "lr": 0.05}
    pipe = pipeline(store, model, stages, opt, 2)
    pipe.run("run_round", 0)
    before = pipe.weights()
    assert any("running_mean" in k for k in before)
    got = summed(pipe, pipe.run("run_eval", 1, 2))
    after = pipe.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # incl. num_batches_tracked
    assert all(m.training for r in pipe.runners.values() for m in r.module.modules())
    loss, correct, samples = reference_eval(model, 7, before, 64, dataset=HELD_OUT)
    assert got[0] == pytest.approx(loss, rel=1e-4)
    assert got[1:] == (correct, samples)


def test_evaluating_weights_the_worker_does_not_hold_is_refused(store):
    stages = [{"start": 0, "end": 7, "devices": [{"device": "a"}]}]
    pipe = pipeline(store, SMALL_CNN, stages, COSINE, 2)
    with pytest.raises(AsteroidError, match="holds those of round 0"):
        pipe.runners["a"].run_eval(1, 1)


def test_evaluation_wait_is_bounded_and_restores_train_mode(store):
    stages = [
        {"start": 0, "end": 3, "devices": [{"device": "a"}]},
        {"start": 3, "end": 7, "devices": [{"device": "b"}]},
    ]
    pipe = pipeline(store, SMALL_CNN, stages, COSINE, 2, timeout_s=0.2)
    runner = pipe.runners["b"]  # stage 1 alone: nobody sends it activations
    with pytest.raises(RoundTimeoutError, match="evaluation activations of micro-batch 0"):
        runner.run_eval(0, 1)
    assert runner.module.training


def test_a_replicated_stage_stepping_on_a_host_copy_matches_the_reference(store, monkeypatch):
    """What a replicated stage on a GPU does (`steps_on_host`), forced here on the CPU.

    The optimizer steps a separate host module and the computing module gets its
    weights copied after each step: the run equals single-process training, each
    replica's checkpoint digest agrees, and the copies hold the same bits.
    """
    monkeypatch.setattr(
        "services.worker.stage.steps_on_host", lambda compute, replicas: replicas > 1
    )
    pipe = pipeline(store, SMALL_CNN, HYBRID, COSINE, 3)
    losses = []
    for r in range(3):
        done = pipe.run("run_round", r)
        losses.append(sum(done[d].loss_sum for d in pipe.last_stage()))
    ref_final, ref_losses = reference_train(SMALL_CNN, 7, 32, 3, COSINE, dataset=HELD_OUT)
    assert_matches_reference(pipe.weights(), ref_final)
    assert_losses_match(losses, ref_losses)
    for name, runner in pipe.runners.items():
        assert (runner.master is not runner.module) == (name != "c"), name
        for (key, live), (_, stepped) in zip(
            runner.module.state_dict().items(), runner.master.state_dict().items(), strict=True
        ):
            assert torch.equal(live, stepped), (name, key)
    digests = {name: stage_digest(r.master, r.optimizer) for name, r in pipe.runners.items()}
    assert digests["a"] == digests["b"] and digests["d"] == digests["e"]


def test_a_host_step_keeps_batchnorm_statistics_in_both_copies(store, monkeypatch):
    model = {"name": "mobilenet_v2", "options": {"width_mult": 0.25}}  # 20 layers
    stages = [
        {"start": 0, "end": 12, "devices": [{"device": "a"}, {"device": "b"}]},
        {"start": 12, "end": 20, "devices": [{"device": "c"}]},
    ]
    plain = pipeline(store, model, stages, COSINE, 2)
    for r in range(2):
        plain.run("run_round", r)
    monkeypatch.setattr(
        "services.worker.stage.steps_on_host", lambda compute, replicas: replicas > 1
    )
    hosted = pipeline(store, model, stages, COSINE, 2)
    for r in range(2):
        hosted.run("run_round", r)
    assert_matches_reference(hosted.weights(), plain.weights(), tol=0.0)
    for name in ("a", "b"):
        runner = hosted.runners[name]
        assert runner.master is not runner.module
        for key, value in runner.master.state_dict().items():
            assert torch.equal(value, runner.module.state_dict()[key]), (name, key)
