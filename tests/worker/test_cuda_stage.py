"""Stages computing on a GPU, against single-process training on the same GPU.

A whole hybrid plan's runners in one process, every one on the GPU, trained
for a few rounds: the weights and losses match the plain single-process
training of the same model on the same GPU within `GPU_TOLERANCE`, each
group's replicas hold the same bits (their optimizer steps on the host), and
what crosses between stages, what a checkpoint holds and what a held layer
keeps is host memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.checkpoint import restore_optimizer, stage_digest, stage_tensors
from common.job import JobSpec
from common.plan import Plan
from services.worker.stage import layers_state
from tests.gpu import CUDA_MARKS, exact_cuda
from tests.reference import assert_losses_match, assert_matches_reference, reference_train
from tests.worker.local_pipeline import LocalPipeline

pytestmark = CUDA_MARKS

GPU_TOLERANCE = 1e-5
"""Max-abs weight (and loss) difference from the same GPU's single-process training.

The micro-batched pipeline sums each gradient over four micro-batches and over
two replicas, where the reference sums it over the whole batch at once:
float32 round-off of a reordered sum, as on a CPU (1e-6 there), with room for
the GPU's own reduction kernels, which split sums by batch shape.
"""
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
# stage 0 = 2 devices splitting 5:3, stage 1 = 1 device, stage 2 = 2 devices 1:1
HYBRID = [
    {"start": 0, "end": 3, "devices": [{"device": "a", "share": 5}, {"device": "b", "share": 3}]},
    {"start": 3, "end": 5, "devices": [{"device": "c"}]},
    {"start": 5, "end": 7, "devices": [{"device": "d"}, {"device": "e"}]},
]
ROUNDS = 4
WHOLE = [{"start": 0, "end": 7, "devices": [{"device": "a"}]}]


@pytest.fixture
def exact_gpu() -> Iterator[torch.device]:
    with exact_cuda() as device:
        yield device


def test_gpu_stages_match_gpu_single_process_training(store, exact_gpu):
    job = JobSpec.model_validate(
        {
            "job_id": "gpu",
            "model": {"name": "small_cnn"},
            "seed": 7,
            "rounds": ROUNDS,
            "optimizer": SGD,
        }
    )
    plan = Plan(global_batch=32, microbatches=4, stages=HYBRID)
    pipe = LocalPipeline(store, job, plan, compute=exact_gpu)
    for runner in pipe.runners.values():
        assert all(p.device == exact_gpu for p in runner.module.parameters())
    losses = []
    for r in range(ROUNDS):
        done = pipe.run("run_round", r)
        losses.append(sum(done[d].loss_sum for d in pipe.last_stage()))
    ref, ref_losses = reference_train({"name": "small_cnn"}, 7, 32, ROUNDS, SGD, device=exact_gpu)
    assert_matches_reference(pipe.weights(), ref, tol=GPU_TOLERANCE)
    assert_losses_match(losses, ref_losses, tol=GPU_TOLERANCE)
    # replicas of a group hold the same bits: the all-reduce's one sum reached both
    for group in (("a", "b"), ("d", "e")):
        digests = {stage_digest(pipe.runners[d].master, pipe.runners[d].optimizer) for d in group}
        assert len(digests) == 1, f"replicas {group} differ"
        for d in group:  # stepped on the host (`steps_on_host`), computed on the GPU
            assert all(p.device.type == "cpu" for p in pipe.runners[d].master.parameters())
            assert all(p.device == exact_gpu for p in pipe.runners[d].module.parameters())
    # what leaves a stage is host memory; a lone stage's optimizer state stays on the GPU
    runner = pipe.runners["c"]
    for tensors in stage_tensors(runner.module, runner.optimizer, runner.start).values():
        assert all(t.device.type == "cpu" for t in tensors.values())
    for state in runner.optimizer.state.values():
        assert state["momentum_buffer"].device == exact_gpu
    assert not pipe.out.dropped


def test_a_gpu_stage_restores_optimizer_state_on_the_gpu(store, exact_gpu):
    """State saved from a GPU stage (host tensors) loads back onto the GPU, bit for bit."""
    job = JobSpec.model_validate(
        {"job_id": "gpu-restore", "model": {"name": "small_cnn"}, "seed": 3, "optimizer": SGD}
    )
    plan = Plan(
        global_batch=8,
        microbatches=2,
        stages=[{"start": 0, "end": 7, "devices": [{"device": "a"}]}],
    )
    pipe = LocalPipeline(store, job, plan, compute=exact_gpu)
    pipe.run("run_round", 0)
    runner = pipe.runners["a"]
    held = runner.layers()
    before = stage_digest(runner.module, runner.optimizer)

    weights, optim = layers_state(held, 0, 7)
    runner.module.load_state_dict(weights)
    restore_optimizer(runner.module, runner.optimizer, optim)
    assert stage_digest(runner.module, runner.optimizer) == before
    for state in runner.optimizer.state.values():
        assert state["momentum_buffer"].device == exact_gpu
    pipe.run("run_round", 1)  # the optimizer steps with what was restored
    assert torch.isfinite(next(runner.module.parameters())).all()
