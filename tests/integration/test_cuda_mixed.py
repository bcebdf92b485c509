"""A CUDA worker beside two CPU workers trains what one CPU process trains.

Real worker and coordinator processes, real sockets and Redis: the CUDA
worker runs stage 0 (the convolutions) on the GPU, the two CPU workers run
stage 1 as a data-parallel pair. The committed weights are compared with
single-process CPU training from the same seed within `MIXED_TOLERANCE`.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.checkpoint import checkpoint_digests, load_full_state
from common.store import Store
from tests.cluster import LocalCluster
from tests.gpu import CUDA_MARKS
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_train,
)

pytestmark = [pytest.mark.integration, *CUDA_MARKS]

MIXED_TOLERANCE = 1e-4
"""Max-abs weight and loss difference from CPU training, after five rounds.

The GPU's float32 (TF32 is off in workers: `common.accelerator.full_precision`)
rounds each operation as the CPU does, but its convolution and reduction
kernels sum in other orders than the CPU's: a few float32 ulps (1e-7
relative) per operation, compounded over five SGD steps with momentum, where
the CPU-only pipeline's reordering stays within 1e-6. A hundred times that
leaves room for the kernels cuDNN picks on another GPU; `make gpu-check`
records the difference measured.
"""
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
ROUNDS = 5
WORKERS = {"gpu": "cuda", "cpu-a": "cpu", "cpu-b": "cpu"}
STAGES: list[dict[str, Any]] = [
    {"start": 0, "end": 3, "devices": [{"device": "gpu", "share": 1}]},
    {"start": 3, "end": 7, "devices": [{"device": "cpu-a"}, {"device": "cpu-b"}]},
]


def test_a_cuda_worker_and_two_cpu_workers_train_to_the_cpu_reference(
    tmp_path, redis_url, cluster_name
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    try:
        for name, accelerator in WORKERS.items():
            cluster.spawn(
                name, ["-m", "services.worker.main", "--device", name, "--accelerator", accelerator]
            )
            cluster.workers.append(name)
        job = {
            "job_id": "mixed",
            "model": {"name": "small_cnn"},
            "seed": 7,
            "rounds": ROUNDS,
            "optimizer": SGD,
        }
        plan = {"global_batch": 32, "microbatches": 4, "stages": STAGES}
        code = cluster.run(job, plan)
        assert code == 0, cluster.log("coordinator")
        assert '"accelerator": "cpu"' not in cluster.log("gpu"), "the CUDA worker ran on its CPU"
        cluster.wait_workers_exit()
        store = Store(redis_url, cluster_name)
        weights = load_full_state(store, "mixed", ROUNDS)
        digests = checkpoint_digests(store, "mixed", ROUNDS)
        metrics = store.read("metrics", "mixed")
        store.close()
    finally:
        cluster.close()
    assert len(set(digests[1].values())) == 1, f"the CPU replicas differ: {digests[1]}"
    ref, ref_losses = reference_train({"name": "small_cnn"}, 7, 32, ROUNDS, SGD)
    assert_matches_reference(weights, ref, tol=MIXED_TOLERANCE)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert_losses_match(losses, ref_losses, tol=MIXED_TOLERANCE)
