"""A learning-rate schedule keeps distributed training equal to single-process training.

Every worker sets the rate of each round from the pure `learning_rate`, as the
reference does, so the hybrid plan still matches it within the equivalence
tolerance; a warm-up and a decay make a forgotten or shifted schedule visible.
The job's closing held-out evaluation, as the coordinator reports it, matches
the reference's evaluation of the same weights.
"""

from __future__ import annotations

import pytest

from tests.integration.test_equivalence import PLANS, SGD, losses, run_job
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_eval,
    reference_train,
)

pytestmark = pytest.mark.integration

# Warm-up of one round, then the schedule proper for the other rounds.
SCHEDULES = {
    "cosine": {**SGD, "schedule": {"kind": "cosine", "warmup_rounds": 1, "min_lr": 0.005}},
    "step": {
        **SGD,
        "schedule": {"kind": "step", "step_rounds": 2, "gamma": 0.5, "warmup_rounds": 1},
    },
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_with_warmup_matches_single_process(tmp_path, redis_url, cluster_name, name):
    model, optimizer = {"name": "small_cnn"}, SCHEDULES[name]
    _, weights, metrics = run_job(
        tmp_path, redis_url, cluster_name, model, PLANS["hybrid"], optimizer=optimizer
    )
    ref, ref_losses = reference_train(model, 7, 32, 5, optimizer)
    assert_matches_reference(weights, ref)
    assert_losses_match(losses(metrics), ref_losses)
    # the coordinator evaluates after the last round: 16 batches of 32 cover eval_size 512
    (final,) = [m for m in metrics if "eval_loss" in m]
    loss, correct, samples = reference_eval(model, 7, ref, 512)
    assert final["eval_samples"] == samples
    assert final["eval_loss"] == pytest.approx(loss / samples, rel=1e-4)
    assert final["eval_accuracy"] == pytest.approx(correct / samples, abs=1e-9)
