"""1F1B keeps at most K_p micro-batches of activations alive; GPipe keeps M.

The worker records the largest number of micro-batches whose forward
activations it held during each round; the test reads it back from the
metrics stream.
"""

from __future__ import annotations

import pytest

from tests.integration.test_equivalence import PLANS, run_job

pytestmark = pytest.mark.integration

M = 8


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
def test_activations_alive_bounded_by_policy(tmp_path, redis_url, cluster_name, policy):
    stages = PLANS["pipeline"]
    _, _, metrics = run_job(
        tmp_path,
        redis_url,
        cluster_name,
        {"name": "small_cnn"},
        stages,
        rounds=2,
        m=M,
        batch=32,
        policy=policy,
    )
    s = len(stages)
    for entry in (m for m in metrics if "loss" in m):
        for dev in entry["devices"].values():
            k = min(2 * (s - dev["stage"]) - 1, M)
            if policy == "1f1b":
                assert 1 <= dev["max_alive"] <= k, entry
            else:
                assert dev["max_alive"] == M, entry
        if policy == "1f1b":  # the first stage does pipeline: several in flight, < M
            first = [d for d in entry["devices"].values() if d["stage"] == 0]
            assert 1 < first[0]["max_alive"] < M
