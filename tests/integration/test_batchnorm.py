"""Batch-norm models: the loss curve follows single-process training.

Exact equality cannot hold: each replica normalises with the statistics of
its own slice of a micro-batch, not of the global batch. Documented
tolerance: per-round loss within 0.15 absolute of the reference (observed:
at most 0.043 over 5 rounds with a 5:3 split of 8-sample micro-batches).
"""

from __future__ import annotations

import pytest

from tests.integration.test_equivalence import run_job
from tests.reference import reference_train

pytestmark = pytest.mark.integration

LOSS_TOLERANCE = 0.15
MODEL = {"name": "mobilenet_v2", "options": {"width_mult": 0.5}}
OPT = {"kind": "sgd", "lr": 0.05, "momentum": 0.9}


def test_mobilenet_v2_loss_curve_within_tolerance(tmp_path, redis_url, cluster_name):
    from common.zoo import ModelSpec, build_model

    n = len(build_model(ModelSpec.model_validate(MODEL), 7).layers)
    cut = n // 2
    stages = [
        {
            "start": 0,
            "end": cut,
            "devices": [{"device": "a", "share": 5}, {"device": "b", "share": 3}],
        },
        {"start": cut, "end": n, "devices": [{"device": "c"}]},
    ]
    _, _, metrics = run_job(
        tmp_path, redis_url, cluster_name, MODEL, stages, rounds=5, m=4, batch=32, optimizer=OPT
    )
    _, ref = reference_train(MODEL, 7, 32, 5, OPT)
    losses = [m["loss"] for m in metrics if "loss" in m]
    diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
    print("loss", losses, "reference", ref, "max diff", max(diffs))
    assert max(diffs) < LOSS_TOLERANCE, (losses, ref)
