"""Devices split by Duan & Wu's beta run forwards and backwards at once and train exactly.

Real worker and coordinator processes: the plan gives some allocations a
`forward_share`, so those workers run `next_pair`'s backward and forward side
by side on two lanes. Weights only change at the round's optimizer step, so
the round is still one step of single-device training: final weights and every
round's loss equal the single-process reference from the same seed. That the
lanes really overlapped shows in the round metrics: a split device's forward
and backward seconds plus its waits, all-reduce and step add up to more than
the round it reported.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_equivalence import SGD, run_job, stage
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
ROUNDS = 4
M = 8


def _split(spec: dict[str, Any], *betas: float | None) -> dict[str, Any]:
    """`spec` with the given forward share on each of its devices (None: not split)."""
    devices = [
        {**a, "forward_share": b} if b is not None else a
        for a, b in zip(spec["devices"], betas, strict=True)
    ]
    return {**spec, "devices": devices}


PLANS = {
    # every stage split, two pipeline stages
    "pipeline": [_split(stage(0, 4, "a"), 0.5), _split(stage(4, 7, "b"), 0.4)],
    # a split group all-reducing with an unsplit device, then an unsplit stage
    "hybrid": [_split(stage(0, 3, "a", "b"), 0.6, None), stage(3, 7, "c")],
}


def _overlapped(timings: dict[str, Any]) -> bool:
    busy = sum(timings[k] for k in ("forward_s", "backward_s", "wait_s", "allreduce_s", "step_s"))
    return bool(busy > timings["total_s"])


@pytest.mark.parametrize("name", sorted(PLANS))
def test_split_devices_train_like_one_device_with_overlapping_lanes(
    tmp_path, redis_url, cluster_name, name
):
    stages = PLANS[name]
    _, weights, metrics = run_job(
        tmp_path, redis_url, cluster_name, MODEL, stages, rounds=ROUNDS, m=M, batch=32
    )
    ref, ref_losses = reference_train(MODEL, 7, 32, ROUNDS, SGD)
    assert_matches_reference(weights, ref)
    rounds = [m for m in metrics if "loss" in m]
    assert_losses_match([m["loss"] for m in rounds], ref_losses)
    # the first stage's inputs are always ready, so its pairs are full once K_p is reached
    split = [a["device"] for a in stages[0]["devices"] if "forward_share" in a]
    for device in split:
        assert any(_overlapped(m["devices"][device]) for m in rounds), (
            f"device {device} never ran a forward and a backward at once: "
            f"{[m['devices'][device] for m in rounds]}"
        )
