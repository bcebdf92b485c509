"""Batch-norm models: weights and running statistics match the sliced reference.

Each device of a stage normalises its own slice of every micro-batch, so a
batch-norm model cannot match whole-batch training; it must match, at the
same 1e-6 as every other equivalence test, a single-process reference that
normalises each device's slice separately and averages the buffers by
samples (`tests.reference_bn`). Running means and variances and
`num_batches_tracked` are compared as well as the weights; that every
replica of a group holds the same state is checked by the coordinator's
replica digests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from common.plan import Plan
from tests.integration.test_equivalence import run_job, stage
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_train,
    weight_difference,
)
from tests.reference_bn import reference_train_sliced

pytestmark = pytest.mark.integration

MODEL = {"name": "mobilenet_v2", "options": {"width_mult": 0.25}}  # 20 layers
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
ROUNDS, BATCH, MICROBATCHES = 3, 16, 2
PLANS = {
    # 8-sample micro-batches: stage 0 splits 5:3, stage 1 splits 3:5, so the
    # sample ranges cross between stages and both stages normalise per slice
    "split": [stage(0, 10, ("a", 5), ("b", 3)), stage(10, 20, "c", ("d", 2))],
    "pipeline": [stage(0, 7, "a"), stage(7, 14, "b"), stage(14, 20, "c")],
}
WRONG_SEMANTICS = {"split": "whole-micro-batch statistics", "pipeline": "whole-batch statistics"}
WRONG_SEMANTICS_GAP = 1e-4
"""The runtime must be further than this from training under the wrong statistics."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the reference on one thread, as each worker does, so it is not starved."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _plan(stages: list[dict[str, Any]]) -> Plan:
    return Plan.model_validate(
        {"global_batch": BATCH, "microbatches": MICROBATCHES, "stages": stages}
    )


def _floats(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if v.is_floating_point()}


def _buffers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in names}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", sorted(PLANS))
def test_mobilenet_v2_matches_sliced_reference(tmp_path, redis_url, cluster_name, name):
    stages = PLANS[name]
    _, weights, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        MODEL,
        stages,
        rounds=ROUNDS,
        m=MICROBATCHES,
        batch=BATCH,
        optimizer=SGD,
    )
    plan = _plan(stages)
    ref, ref_losses = reference_train_sliced(MODEL, 7, plan, ROUNDS, SGD)
    buffers = _buffers(ref)
    assert any(k.endswith("num_batches_tracked") for k in buffers), sorted(ref)
    assert_matches_reference(_buffers(weights), buffers, what="batch-norm buffers")
    assert_matches_reference(weights, ref)
    assert_losses_match([m["loss"] for m in metrics if "loss" in m], ref_losses)
    # the same comparison against the wrong semantics must fail by far more than 1e-6
    if name == "split":
        wrong, _ = reference_train_sliced(MODEL, 7, plan, ROUNDS, SGD, per_device=False)
    else:
        wrong, _ = reference_train(MODEL, 7, BATCH, ROUNDS, SGD)
    key, gap = weight_difference(_floats(weights), _floats(wrong))
    assert gap > WRONG_SEMANTICS_GAP, (
        f"plan {name}: the runtime is only {gap:.3g} (at {key}) from training with "
        f"{WRONG_SEMANTICS[name]}; the comparison cannot tell the semantics apart"
    )


@pytest.mark.usefixtures("one_thread")
def test_sliced_reference_is_plain_training_without_batchnorm():
    """Without batch-norm, slicing, routing and buffer averaging change nothing."""
    model = {"name": "small_cnn"}
    plan = Plan.model_validate(
        {
            "global_batch": 32,
            "microbatches": 4,
            "stages": [stage(0, 3, ("a", 5), ("b", 3)), stage(3, 7, "c", ("d", 2))],
        }
    )
    sliced, sliced_losses = reference_train_sliced(model, 7, plan, 3, SGD)
    plain, plain_losses = reference_train(model, 7, 32, 3, SGD)
    assert_matches_reference(sliced, plain, what="sliced reference")
    assert_losses_match(sliced_losses, plain_losses)
